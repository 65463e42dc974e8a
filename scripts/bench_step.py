"""Batched decode step time through the engine, the kernels each step launches, and the roofline.

    python scripts/bench_step.py --model scripts/configs/llama-3-8b --load-format dummy \
        --batch 1,32 --quantization none,int8,int4 [--context 512] [--steps 24] [--layers N]
        [--trace-dir DIR] [--json-out FILE] [--hf] [--attention-backend B]
        [--scheduling async,sync] [--cprofile PREFIX] [--linear-backend xla,gpu]
        [--linear-tuning FILE]   # bench_linear_gpu.py --tuned-out: the GPU kernel's blocks
        [--decode-programs-per-core N]   # the GPU attention's split-K target (0: no split)

1. One `LLM` per `--quantization` (random weights with `--load-format dummy`; `--layers N` keeps
   the first N layers of the config, for a quick look on a CPU), sized for the largest batch.
2. Per batch size B: B greedy requests of `--context` prompt tokens (prefix caching off, distinct
   prompts), `ignore_eos`. Once every row decodes, the time between successive engine steps that
   return tokens is one decode step as a client sees it, host work included; the median over
   `--steps` steps gives ms/step and B / step tokens/s. A warm-up round compiles the programs.
3. With `--trace-dir`, a few more decode steps run under `jax.profiler.trace`. From its perfetto
   trace: device events per step (kernels, copies, memsets; read from every process whose name is
   not a host's) and their summed busy time per step, against the step interval (the gap is
   host time the device waited). Event names and counts go to `<dir>/kernels-<case>.json`.
4. Roofline per step: the weight bytes plus the KV bytes the batch's rows read, over the device's
   copy bandwidth measured in the same run (a large on-device copy, bytes read + written).
5. With `--hf`, HF transformers' eager model on the same config (random bf16 weights, on the GPU
   when torch sees one): B rows of `--context` prompt tokens, then the median time of a greedy
   decode forward with its KV cache, the sampled ids brought to the host each step.
Prints a table and one JSON line (BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import shutil
import statistics
import tempfile
import time

import _path  # noqa: F401
import numpy as np
from _timing import median_time
from bench_generate import weight_bytes

from jaxinfer import LLM, SamplingParams


def model_dir(path: str, layers: int | None) -> str:
    """`path`, or a copy of its config.json keeping the first `layers` layers."""
    if not layers:
        return path
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["num_hidden_layers"] = layers
    out = tempfile.mkdtemp(prefix="bench-step-")
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f)
    return out


def copy_bandwidth(nbytes: int = 2 << 30, runs: int = 9) -> float:
    """Bytes/s (read + written) of a jitted on-device copy of `nbytes`."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((nbytes // 4,), jnp.float32)
    copy = jax.jit(lambda a: a * 1.0001)
    return 2 * x.nbytes / median_time(lambda: copy(x), runs)


def kv_bytes_per_token(llm, num_pages: int, page_size: int) -> int:
    """The paged KV cache's bytes (K and V, every layer) per cached token."""
    import jax

    total = sum(x.nbytes for x in jax.tree.leaves(llm.engine.runner.kv_caches))
    return total // (num_pages * page_size)


def decode_tokens(batch: int, context: int, steps: int, chunk: int) -> int:
    """Tokens each request generates: the timed steps, the profiled ones and the warm-up, plus
    one per prefill step (the first row decodes while the last prompts still prefill in chunks
    of `chunk` tokens: it must outlive them for every row to decode at once)."""
    return steps + 12 + -(-batch * context // chunk) + 8


def run_batch(llm, batch: int, context: int, steps: int, tag: str, vocab: int, trace=None):
    """Median seconds between token-returning decode steps with `batch` rows decoding."""
    eng = llm.engine
    rng = np.random.default_rng(batch)
    sp = SamplingParams(
        max_tokens=decode_tokens(batch, context, steps, llm.engine.config.max_num_batched_tokens),
        temperature=0,
        ignore_eos=True,
    )
    for i in range(batch):
        ids = [int(t) for t in rng.integers(100, vocab - 1, context)]
        eng.add_request(ids, sp, request_id=f"{tag}-{batch}-{i}")
    stamps = []
    profiled = None
    while eng.has_unfinished():
        deltas = eng.step()
        if sum(1 for d in deltas if d.new_token_ids) == batch:
            stamps.append(time.perf_counter())
        if trace and len(stamps) == steps + 2 and profiled is None:
            profiled = profile_steps(eng, trace, 8)
    diffs = np.diff(stamps[2 : steps + 2])
    return float(np.median(diffs)), profiled


def host_profile(llm, batch: int, args, vocab: int, path: str) -> None:
    """cProfile of the engine's host work over one more timed round (top 60 by cumulative)."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    run_batch(llm, batch, args.context, args.steps, "cprofile", vocab)
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(60)
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(40)
    with open(path, "w") as f:
        f.write(text.getvalue())


def profile_steps(eng, trace_dir: str, n: int):
    """Runs `n` engine steps under the profiler; device events and busy time per step."""
    import jax

    shutil.rmtree(trace_dir, ignore_errors=True)
    t = time.perf_counter()
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        for _ in range(n):
            eng.step()
        jax.effects_barrier()
    wall = time.perf_counter() - t
    files = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
    if not files:
        return {"error": "no perfetto trace written"}
    with gzip.open(files[0]) as f:
        events = json.load(f)["traceEvents"]
    names = {
        e["pid"]: e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    device = {p for p, name in names.items() if "host" not in name.lower()}
    counts: collections.Counter = collections.Counter()
    ms: collections.Counter = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in device:
            counts[e["name"]] += 1
            ms[e["name"]] += e.get("dur", 0) / 1e3
    busy = sum(ms.values())
    return {
        "steps": n,
        "device_processes": sorted(names[p] for p in device),
        "events_per_step": sum(counts.values()) / n,
        "device_busy_ms_per_step": busy / n,
        "profiled_wall_ms_per_step": 1e3 * wall / n,
        "top": [  # name, launches per step, device ms per step; the longest first
            (name, counts[name] / n, round(t / n, 4)) for name, t in ms.most_common(40)
        ],
    }


def bench_hf(path: str, batches: list[int], context: int, steps: int) -> list[dict]:
    """HF transformers' eager forward with its KV cache on the same config (random weights, the
    benchmark's dtype as bf16, the torch device `cuda` when there is one): ms per decode step."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = AutoConfig.from_pretrained(path)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(cfg).eval()
    torch.set_default_dtype(torch.float32)
    rows = []
    for b in batches:
        ids = torch.randint(100, cfg.vocab_size - 1, (b, context), device=dev)
        times = []
        with torch.inference_mode():
            for rnd in range(2):  # round 0 warms up
                out = model(ids, use_cache=True)
                past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
                for _ in range(steps if rnd else 4):
                    if dev == "cuda":
                        torch.cuda.synchronize()
                    t = time.perf_counter()
                    out = model(tok, past_key_values=past, use_cache=True)
                    past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
                    tok = tok.cpu().to(dev)  # the sampled ids reach the host, as a server's do
                    if rnd:
                        times.append(time.perf_counter() - t)
        step = statistics.median(times)
        rows.append({"batch": b, "ms_per_step": round(1e3 * step, 3), "tok_s": round(b / step, 1)})
        print(json.dumps({"hf": rows[-1]}), flush=True)
    del model
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="scripts/configs/llama-3-8b")
    p.add_argument("--load-format", default="dummy", choices=("auto", "dummy"))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--batch", default="1,32")
    p.add_argument("--quantization", default="none")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--trace-dir", default=None)
    p.add_argument("--json-out", default=None)
    p.add_argument("--attention-backend", default=None, help="default: the platform's kernel")
    p.add_argument("--linear-backend", default="auto", help="auto, xla, gpu, cpu (comma-separated)")
    p.add_argument("--scheduling", default="async", help="async, sync (comma-separated)")
    p.add_argument("--cprofile", default=None, help="path prefix: a host cProfile per case")
    p.add_argument("--hf", action="store_true", help="also HF transformers on the same config")
    p.add_argument(
        "--linear-tuning",
        default=None,
        help="bench_linear_gpu.py --tuned-out FILE: GPU kernel blocks",
    )
    p.add_argument(
        "--decode-programs-per-core",
        default=None,
        help="comma-separated: the GPU decode attention's split-K programs per SM, one engine "
        "each (block_sizes.DECODE_PROGRAMS_PER_CORE; 0: one program a sequence and KV head, "
        "no merge launch)",
    )
    args = p.parse_args()
    import jax

    from pallas_kernels.ragged_paged_attention import block_sizes

    if args.linear_tuning:
        from pallas_kernels.linear import gpu as gpu_linear

        with open(args.linear_tuning) as f:
            gpu_linear.load_tuned(json.load(f))

    batches = [int(b) for b in args.batch.split(",")]
    path = model_dir(args.model, args.layers)
    bandwidth = copy_bandwidth(2 << 30 if jax.default_backend() != "cpu" else 256 << 20)
    rows = []
    per_core = args.decode_programs_per_core
    cases = [
        (q, lin, m, n)
        for q in args.quantization.split(",")
        for lin in args.linear_backend.split(",")
        for m in args.scheduling.split(",")
        for n in (per_core.split(",") if per_core else [block_sizes.DECODE_PROGRAMS_PER_CORE])
    ]
    for quant, linear, sched, programs in cases:
        if per_core:  # read while tracing: JAX's trace caches are shared by equal engines
            block_sizes.DECODE_PROGRAMS_PER_CORE = int(programs)
            jax.clear_caches()
        t0 = time.perf_counter()
        chunk = max(512, args.context)
        max_len = args.context + decode_tokens(max(batches), args.context, args.steps, chunk)
        num_pages = max(batches) * (-(-max_len // 16) + 1) + 4
        llm = LLM(
            path,
            dtype=args.dtype,
            load_format=args.load_format,
            skip_tokenizer_init=True,
            quantization=quant,
            max_model_len=max_len,
            page_size=16,
            num_pages=num_pages,
            enable_prefix_caching=False,
            max_num_seqs=max(batches),
            max_num_batched_tokens=chunk,
            attention_backend=args.attention_backend,
            linear_backend=linear,
            async_scheduling=sched == "async",
        )
        load_s = time.perf_counter() - t0
        vocab = llm.model.cfg.vocab_size
        wbytes = weight_bytes(llm)
        for b in batches:
            t0 = time.perf_counter()
            run_batch(llm, b, args.context, 4, f"warm-{quant}", vocab)  # compiles
            warm_s = time.perf_counter() - t0
            tag = quant if linear == "auto" else f"{quant}-{linear}"
            tag += f"-p{programs}" if per_core else ""
            trace = os.path.join(args.trace_dir, f"{tag}-b{b}") if args.trace_dir else None
            step, prof = run_batch(llm, b, args.context, args.steps, f"run-{quant}", vocab, trace)
            if args.cprofile:
                host_profile(llm, b, args, vocab, f"{args.cprofile}-{tag}-{sched}-b{b}.txt")
            kv = b * (args.context + args.steps // 2) * kv_bytes_per_token(llm, num_pages, 16)
            floor = (wbytes + kv) / bandwidth
            row = {
                "quantization": quant,
                "linear_backend": linear,
                "scheduling": sched,
                "decode_programs_per_core": int(programs),
                "batch": b,
                "ms_per_step": round(1e3 * step, 3),
                "tok_s": round(b / step, 1),
                "roofline_ms": round(1e3 * floor, 3),
                "weight_bytes": wbytes,
                "kv_bytes": kv,
                "load_s": round(load_s, 1),
                "first_round_s": round(warm_s, 1),
            }
            if prof:
                row["profile"] = {k: v for k, v in prof.items() if k != "top"}
                with open(os.path.join(args.trace_dir, f"kernels-{tag}-b{b}.json"), "w") as f:
                    json.dump(prof, f, indent=1)
            rows.append(row)
            print(json.dumps(row), flush=True)
        del llm
    print(f"device {jax.devices()[0].device_kind}, copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    print(f"{'case':>20s} {'ms/step':>9s} {'tok/s':>9s} {'roofline ms':>12s} {'events/step':>12s}")
    for r in rows:
        ev = r.get("profile", {}).get("events_per_step")
        case = f"{r['quantization']} {r['linear_backend']} {r['scheduling']} b{r['batch']}"
        case += f" p{r['decode_programs_per_core']}" if per_core else ""
        print(
            f"{case:>20s} {r['ms_per_step']:9.2f} "
            f"{r['tok_s']:9.1f} {r['roofline_ms']:12.2f} {ev if ev is not None else '-':>12}"
        )
    hf = bench_hf(path, batches, args.context, args.steps) if args.hf else None
    for r in hf or []:
        print(f"{'hf b' + str(r['batch']):>20s} {r['ms_per_step']:9.2f} {r['tok_s']:9.1f}")
    out = {
        "bench": "step",
        "hf": hf,
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "copy_gb_s": round(bandwidth / 1e9, 1),
        "model": args.model,
        "layers": args.layers,
        "context": args.context,
        "steps": args.steps,
        "rows": rows,
    }
    print(json.dumps(out))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
