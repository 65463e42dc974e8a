"""Step time and bytes per device of the sharded model, per mesh.

    python scripts/bench_parallel.py                                  # default meshes, tiny model
    python scripts/bench_parallel.py --meshes "tensor=8;data=2,tensor=4" --layers 8 --hidden 1024
    python scripts/bench_parallel.py --model path/to/hf_or_gguf --meshes "tensor=1;tensor=8"
    python scripts/bench_parallel.py --moe --meshes "expert=4;tensor=8"  # Mixtral-style params

1. Build the model once: a checkpoint (`--model`) or a random tiny Llama scaled by the flags
   (`--moe`: Mixtral-style experts), kept on the host.
2. Per mesh: an `LLMEngine`-shaped `ModelRunner` on that mesh (weights placed by the rules),
   its prefill program (one `--prefill-len` chunk per data replica) and its decode program
   (`--batch` sequences per replica, one token each) compiled, then timed: median of `--runs`
   calls after one warm call, each call blocked until the results are on the host.
3. Print one row per mesh: prefill and decode ms, parameter and KV-cache bytes on device 0.

On CPU, set XLA_FLAGS=--xla_force_host_platform_device_count=8 to get 8 virtual devices (done
here when the flag is absent and the platform is CPU); virtual devices share the host's cores, so
CPU timings show overheads, not speed-ups.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

if (
    "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", "")
    and os.environ.get("JAX_PLATFORMS", "cpu") == "cpu"
):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import _path  # noqa: E402,F401  (repo root on sys.path)

DEFAULT_MESHES = "single;tensor=8;data=2,tensor=4;data=8"  # "single": one device


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--meshes", default=DEFAULT_MESHES, help="';'-separated mesh strings")
    p.add_argument("--model", default=None, help="a checkpoint path (default: random tiny Llama)")
    p.add_argument(
        "--load-format",
        default="auto",
        choices=("auto", "dummy"),
        help="'dummy': random weights from --model's config.json, made on the devices",
    )
    p.add_argument(
        "--moe", action="store_true", help="random Mixtral-style model (8 experts, top-2)"
    )
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batch", type=int, default=8, help="decode sequences per data replica")
    p.add_argument("--prefill-len", type=int, default=128, help="prefill tokens per data replica")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--runs", type=int, default=5)
    return p.parse_args(argv)


def build_model(args: argparse.Namespace):
    import jax

    from jaxinfer.config import ModelConfig
    from jaxinfer.models import llama
    from jaxinfer.params import DTYPES, init_random

    if args.model:
        from jaxinfer.loader import load_model

        model = load_model(args.model, dtype=args.dtype, load_format=args.load_format)
        return model.cfg, model.params
    hf = dict(
        model_type="llama",
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        max_position_embeddings=4096,
    )
    if args.moe:
        hf.update(
            model_type="mixtral",
            num_local_experts=8,
            num_experts_per_tok=2,
            intermediate_size=2 * args.hidden,
        )
    cfg = ModelConfig.from_hf(hf)
    return cfg, init_random(llama.param_specs(cfg, DTYPES[args.dtype]), jax.random.key(0))


def _timed(fn, runs: int) -> float:
    fn()  # compile + warm
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def bench_mesh(cfg, params, spec: str, args: argparse.Namespace) -> dict:
    import jax
    import numpy as np

    from jaxinfer import sharding as shd
    from jaxinfer.config import parse_mesh
    from jaxinfer.engine.runner import ModelRunner

    spec = "" if spec == "single" else spec
    sizes = shd.check_mesh(
        cfg,
        spec,
        num_devices=len(jax.devices()),
        max_num_seqs=args.batch * parse_mesh(spec)[shd.DATA],
    )
    data = sizes[shd.DATA]
    mesh = shd.make_mesh(spec or None)
    seq_len = args.prefill_len + 8
    pages_per_seq = -(-seq_len // args.page_size)
    num_pages = data * (args.batch * pages_per_seq + 1)
    runner = ModelRunner(
        cfg,
        params,
        page_size=args.page_size,
        num_pages=num_pages,
        max_model_len=seq_len,
        max_num_seqs=args.batch * data,
        max_num_batched_tokens=max(args.prefill_len, args.batch),
        dtype=args.dtype,
        token_buckets=tuple(sorted({args.batch, args.prefill_len})),
        mesh=mesh,
    )

    from jaxinfer.engine.request import Request
    from jaxinfer.engine.types import ScheduledRequest, SchedulerOutput
    from jaxinfer.sampling_params import SamplingParams

    rng = np.random.default_rng(0)
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = {
        (r, j): rng.integers(0, cfg.vocab_size, args.prefill_len + 1).tolist()
        for r in range(data)
        for j in range(args.batch)
    }

    def inputs(seqs_per_replica: int, tokens_each: int, start: int):
        """The runner's own host inputs for a fabricated schedule (pages j*pages_per_seq + 1...)."""
        scheduled = []
        for (r, j), prompt in prompts.items():
            if j < seqs_per_replica:
                req = Request(f"r{r}-{j}", prompt, sp)
                pages = list(range(1 + j * pages_per_seq, 1 + (j + 1) * pages_per_seq))
                scheduled.append(
                    ScheduledRequest(
                        req,
                        prompt[start : start + tokens_each],
                        start,
                        pages,
                        True,
                        r,
                        is_new=True,
                        page_table=pages,
                    )
                )
        return runner.prepare(SchedulerOutput(scheduled, len(scheduled) * tokens_each, [], []))

    prefill = inputs(1, args.prefill_len, 0)
    decode = inputs(args.batch, 1, args.prefill_len)
    prefill_ms = _timed(lambda: runner.run(prefill), args.runs)
    decode_ms = _timed(lambda: runner.run(decode), args.runs)
    held = runner.bytes_per_device()
    return dict(
        mesh=spec or "single",
        prefill_ms=prefill_ms,
        decode_ms=decode_ms,
        **held,
        tokens_prefill=data * args.prefill_len,
        tokens_decode=data * args.batch,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import jax

    from jaxinfer.params import num_bytes

    cfg, params = build_model(args)
    total = num_bytes(params)
    print(
        f"# {jax.devices()[0].platform} x{len(jax.devices())} ({jax.devices()[0].device_kind}); "
        f"model {cfg.model_type} L={cfg.num_layers} E={cfg.hidden_size} V={cfg.vocab_size} "
        f"experts={cfg.num_experts}; params {total / 2**20:.1f} MiB total; batch {args.batch}/replica, "
        f"prefill {args.prefill_len}/replica; median of {args.runs}"
    )
    print(
        f"{'mesh':<22}{'prefill ms':>11}{'tok':>6}{'decode ms':>11}{'tok':>5}"
        f"{'params MiB/dev':>16}{'x total':>9}{'KV MiB/dev':>12}"
    )
    for spec in [m.strip() for m in args.meshes.split(";") if m.strip()]:
        try:
            r = bench_mesh(cfg, params, spec, args)
        except Exception as e:  # noqa: BLE001 - report the mesh as skipped and go on
            print(f"{spec:<22} skipped: {type(e).__name__}: {str(e)[:200]}")
            continue
        print(
            f"{r['mesh']:<22}{r['prefill_ms']:>11.2f}{r['tokens_prefill']:>6}{r['decode_ms']:>11.2f}"
            f"{r['tokens_decode']:>5}{r['params'] / 2**20:>16.2f}{r['params'] / total:>9.3f}"
            f"{r['kv_cache'] / 2**20:>12.2f}"
        )
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
