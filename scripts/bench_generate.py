"""Single-stream prefill and decode speed of the default model, with HF transformers as the peer.

    python scripts/bench_generate.py [--model PATH] [--prompt-len 128] [--decode-tokens 64] [--runs 5]
                                     [--rounds 1] [--linear-backend cpu,xla] [--scheduling async,sync]
                                     [--num-scheduler-steps 1,8]
                                     [--quantization none,int8,int4] [--llama-cpp BUILD_DIR]
                                     [--load-format dummy]

1. jaxinfer: an `LLM` with one sequence slot (one per `--quantization`, `--linear-backend`,
   `--scheduling` and `--num-scheduler-steps`, their requests taking turns); a warm-up request
   compiles the programs first. Prefill = time from adding the request to the engine step that
   returns its first token (the whole prompt in one step); decode = median time between the steps
   that return the following tokens, per token they return (with async scheduling a step returns
   the tokens of the step launched before it; a multi-step program returns several).
   Each run is one request; medians over runs. `host ms/tok`: CPU time of the engine's own
   thread (scheduling, input building, the program call, output processing: `time.thread_time`)
   per decode token; on a CPU device it shares the cores with the step, so each of those
   milliseconds costs about one of decode (BENCHMARKS.md "Host time in the CPU decode step").
2. HF transformers (when installed), same weights (the GGUF dequantized to f32), same prompt:
   one forward over the prompt, then greedy steps with its KV cache, torch threads = cores.
3. llama.cpp, when `--llama-cpp` names a llama.cpp build directory (`bin/llama-bench`; built by
   the user, nothing of llama.cpp is part of this repository) and the model is a GGUF file: its own
   benchmark on the **same file** (the default model's Q4_1 blocks as they are, not a requantized
   copy), `llama-bench -m GGUF -p PROMPT_LEN -n DECODE_TOKENS -r 1 -t THREADS -o json` once per
   run, between jaxinfer's requests (so a slow phase of a loaded machine hits both alike); the
   row is the median of the runs' tokens/s (`--llama-cpp-threads 2,1`: a row per thread count;
   default: every core).
4. The weight-read roofline of this machine, measured in the same run: a jitted XLA reduction
   streams a buffer twice the size of the weights (so no cache holds it) and the decode roofline is
   that read bandwidth divided by the weights' bytes (every decode step reads every weight once).
5. `--rounds R` (default 1) runs R rounds of `--runs` runs each, every row's requests still taking
   turns run by run (the engines are built and compiled once): each round's decode medians and
   the ratios of every jaxinfer row to the first one and to each llama.cpp row, then each ratio's
   median over the rounds (a ratio measured within one round, so the machine's slow and quick
   minutes divide out; BENCHMARKS.md's alternated rounds). The table's rows stay medians over all
   runs.
`--load-format dummy` benchmarks any architecture from its `config.json` (+ tokenizer) with random
weights made on the device; the HF and llama.cpp peers are skipped then (they lack those weights).
Prints a table (tokens/s) and one JSON line for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time

import _path  # noqa: F401
import numpy as np
from _hf_peer import hf_model_from_gguf
from _timing import median_time

from jaxinfer import LLM, SamplingParams


def bench_jaxinfer(args, prompt_ids, configs: list[tuple[str, str, str, int]], peers=()):
    """One engine per (quantization, linear backend, scheduling, steps a program); their runs
    interleave, so a slow
    phase of a noisy machine hits every configuration alike. Each of `peers` (a callable) runs once
    per run after the engines' requests, run 0 (the compiling one) included."""
    max_len = args.prompt_len + args.decode_tokens + 16
    # NOTE: pages for the one sequence slot, not most of the device's memory (the default): the
    # read-bandwidth probe allocates its own buffer afterwards. No prefix caching: every run
    # repeats the prompt, which would otherwise be served from the cache after run 0.
    llms = [
        LLM(
            args.model,
            dtype=args.dtype,
            load_format=args.load_format,
            max_model_len=max_len,
            page_size=16,
            num_pages=-(-max_len // 16) + 2,
            enable_prefix_caching=False,
            max_num_seqs=1,
            max_num_batched_tokens=max(args.prompt_len, 16),
            linear_backend=backend,
            async_scheduling=scheduling == "async",
            num_scheduler_steps=steps,
            quantization=quant,
        )
        for quant, backend, scheduling, steps in configs
    ]
    vocab = llms[0].model.cfg.vocab_size
    prompt_ids = [t % vocab for t in prompt_ids]  # any architecture (--load-format dummy)
    sp = SamplingParams(max_tokens=args.decode_tokens, temperature=0, ignore_eos=True)
    times = [([], [], []) for _ in configs]  # (prefill, decode, host CPU a token) seconds per run
    rounds = getattr(args, "rounds", 1)
    for run in range(args.runs * rounds + 1):  # run 0 compiles
        for llm, (prefill, decode, host) in zip(llms, times):
            eng = llm.engine
            start = time.perf_counter()
            eng.add_request(prompt_ids, sp, request_id=f"bench-{run}")
            # when each step that returned tokens ended (wall, thread CPU) and how many it returned
            stamps, cpu, counts = [], [], []
            while eng.has_unfinished():
                n = sum(len(d.new_token_ids) for d in eng.step())
                if n:
                    stamps.append(time.perf_counter())
                    cpu.append(time.thread_time())
                    counts.append(n)
            if run:
                prefill.append(stamps[0] - start)
                decode.append(statistics.median(np.diff(stamps) / counts[1:]))
                host.append((cpu[-1] - cpu[0]) / max(1, sum(counts[1:])))
        for peer in peers:
            peer()
    return [
        (
            args.prompt_len / statistics.median(prefill),
            1 / statistics.median(decode),
            weight_bytes(llm),
            f"{quant}, {llm.engine.runner.linear_backend}, {scheduling}"
            + (f", {steps} steps" if steps > 1 else ""),
            1e3 * statistics.median(host),
            per_round(decode, args.runs, lambda seconds: 1 / statistics.median(seconds)),
        )
        for llm, (prefill, decode, host), (quant, _, scheduling, steps) in zip(llms, times, configs)
    ]


def per_round(values: list, runs: int | None, reduce) -> list[float]:
    """`reduce` of each round's `runs` consecutive values (one round of all when `runs` is None)."""
    runs = runs or len(values)
    return [reduce(values[i : i + runs]) for i in range(0, len(values), runs)]


def round_ratios(rows: list[tuple[str, list[float]]], peers: list[tuple[str, list[float]]]):
    """{"A / B": per-round ratios} for every jaxinfer row A after the first over the first (B),
    and every jaxinfer row over each llama.cpp row."""
    pairs = [(a, rows[0]) for a in rows[1:]] + [(a, b) for a in rows for b in peers]
    return {
        f"{a} / {b}": [x / y for x, y in zip(xs, ys, strict=True)] for (a, xs), (b, ys) in pairs
    }


def read_bandwidth(nbytes: int, runs: int = 9) -> float:
    """Median bytes/s of a jitted reduction that reads an f32 buffer of `nbytes` once."""
    import jax
    import jax.numpy as jnp

    cols = 4096
    buf = jnp.ones((max(1, nbytes // (4 * cols)), cols), jnp.float32)
    # Row sums: each thread streams whole rows (a column reduction measured ~3x slower here).
    reduce = jax.jit(lambda x: x.sum(axis=1))
    return buf.nbytes / median_time(lambda: reduce(buf), runs)


def weight_bytes(llm) -> int:
    from jaxinfer.params import num_bytes

    return num_bytes(llm.engine.runner.params)  # NOTE: 4-bit leaves two values a byte


def bench_hf(args, prompt_ids, path):
    loaded = hf_model_from_gguf(path)
    if loaded is None:
        return None
    import torch

    model, _ = loaded
    ids = torch.tensor([prompt_ids])
    prefill, decode = [], []
    with torch.inference_mode():
        for run in range(args.runs + 1):
            t = time.perf_counter()
            out = model(ids, use_cache=True)
            t_prefill = time.perf_counter() - t
            past, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            steps = []
            for _ in range(args.decode_tokens - 1):
                t = time.perf_counter()
                out = model(tok, past_key_values=past, use_cache=True)
                steps.append(time.perf_counter() - t)
                past, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            if run:
                prefill.append(t_prefill)
                decode.append(statistics.median(steps))
    return args.prompt_len / statistics.median(prefill), 1 / statistics.median(decode)


def llama_bench_command(build: str, gguf: str, prompt_len: int, decode_tokens: int, threads: int):
    """One `llama-bench` run of the GGUF file as it is: a prefill test of `prompt_len` tokens and a
    decode test of `decode_tokens`, one repetition each, JSON on stdout."""
    return [
        os.path.join(os.path.abspath(build), "bin", "llama-bench"),
        "-m",
        gguf,
        "-p",
        str(prompt_len),
        "-n",
        str(decode_tokens),
        "-r",
        "1",
        "-t",
        str(threads),
        "-o",
        "json",
    ]


def parse_llama_bench(stdout: str) -> dict:
    """(prefill tok/s, decode tok/s) and what llama.cpp says it ran, from `llama-bench -o json`:
    its prefill test row has `n_prompt` and no `n_gen`, its decode row the reverse."""
    rows = json.loads(stdout)
    prefill = [r for r in rows if r["n_prompt"] and not r["n_gen"]]
    decode = [r for r in rows if r["n_gen"] and not r["n_prompt"]]
    if not prefill or not decode:
        raise ValueError(f"llama-bench printed no prefill and decode tests: {stdout[:200]!r}")
    prefill, decode = prefill[0], decode[0]
    return {
        "prefill_tok_s": float(prefill["avg_ts"]),
        "decode_tok_s": float(decode["avg_ts"]),
        "model_type": decode.get("model_type"),
        "build_commit": decode.get("build_commit"),
        "threads": decode.get("n_threads"),
    }


class LlamaCpp:
    """llama.cpp's benchmark on the GGUF file, one `llama-bench` run per call (a `bench_jaxinfer`
    peer); `result()` is the median over the calls after the first (a warm-up, like run 0)."""

    def __init__(self, build: str, gguf: str, args, threads: int):
        self.command = llama_bench_command(
            build, gguf, args.prompt_len, args.decode_tokens, threads
        )
        self.runs: list[dict] = []
        self.per_round_runs = getattr(args, "runs", None)

    def __call__(self) -> None:
        out = subprocess.run(self.command, check=True, capture_output=True, text=True).stdout
        self.runs.append(parse_llama_bench(out))

    def result(self) -> dict:
        runs = self.runs[1:] or self.runs
        return {
            **runs[-1],
            "prefill_tok_s": statistics.median(r["prefill_tok_s"] for r in runs),
            "decode_tok_s": statistics.median(r["decode_tok_s"] for r in runs),
            "command": " ".join(self.command).replace(" -r 1 ", f" -r 1 (x{len(runs)}) "),
            "per_round_decode_tok_s": per_round(
                [r["decode_tok_s"] for r in runs],
                self.per_round_runs,
                statistics.median,
            ),
        }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
    p.add_argument(
        "--load-format",
        default="auto",
        choices=("auto", "dummy"),
        help="'dummy': random weights from --model's config.json (no peers)",
    )
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="rounds of --runs runs each: per-round decode medians and ratios (every jaxinfer "
        "row over the first, and over each llama.cpp row), then each ratio's median",
    )
    p.add_argument("--no-hf", action="store_true")
    p.add_argument(
        "--linear-backend",
        default="auto",
        help="jaxinfer's dense-product backend(s), comma-separated: auto, xla, cpu "
        "(one jaxinfer row each)",
    )
    p.add_argument(
        "--scheduling",
        default="async",
        help="engine scheduling, comma-separated: async, sync (one jaxinfer row each)",
    )
    p.add_argument(
        "--num-scheduler-steps",
        default="1",
        help="decode steps one program may run (EngineConfig.num_scheduler_steps), "
        "comma-separated (one jaxinfer row each)",
    )
    p.add_argument(
        "--quantization",
        default="none",
        help="weight quantization(s), comma-separated: none, int8, fp8, int4 (one jaxinfer "
        "row each; the roofline row uses the first one's weight bytes)",
    )
    p.add_argument(
        "--llama-cpp",
        metavar="BUILD_DIR",
        default=None,
        help="also run llama.cpp's llama-bench from this build directory on the same GGUF file, "
        "one run per jaxinfer run, between them (GGUF models only)",
    )
    p.add_argument(
        "--llama-cpp-threads",
        default=str(os.cpu_count()),
        help="llama-bench -t, comma-separated (one llama.cpp row each, runs interleaved; "
        "default: every core)",
    )
    args = p.parse_args()
    if args.runs < 1 or args.rounds < 1:
        p.error(f"--runs {args.runs} and --rounds {args.rounds}: both must be at least 1")
    from jaxinfer.default_model import default_model_path

    path = args.model or default_model_path()
    prompt_ids = [int(x) for x in np.random.default_rng(0).integers(100, 40000, args.prompt_len)]
    dummy = args.load_format == "dummy"
    llama_cpp = (
        [LlamaCpp(args.llama_cpp, path, args, int(t)) for t in args.llama_cpp_threads.split(",")]
        if args.llama_cpp and path.endswith(".gguf") and not dummy
        else []
    )
    runs = bench_jaxinfer(
        args,
        prompt_ids,
        [
            (q, b, m, int(n))
            for q in args.quantization.split(",")
            for b in args.linear_backend.split(",")
            for m in args.scheduling.split(",")
            for n in args.num_scheduler_steps.split(",")
        ],
        peers=llama_cpp,
    )
    ours = runs[0]
    if dummy and not args.no_hf:
        print(
            "hf-transformers and llama.cpp peers skipped: --load-format dummy has no weights for them"
        )
    hf = (
        None
        if dummy or args.no_hf or (args.model and not args.model.endswith(".gguf"))
        else bench_hf(args, prompt_ids, path)
    )
    lcpps = [peer.result() for peer in llama_cpp]
    nbytes = ours[2]
    # twice the weights outruns every cache; on an accelerator 4 GiB does too (tens of MB of L2)
    import jax

    probe = 2 * nbytes if jax.default_backend() == "cpu" else min(2 * nbytes, 4 << 30)
    bandwidth = read_bandwidth(probe)
    roofline = bandwidth / nbytes
    print(
        f"{'':34s} {'prefill tok/s':>14s} {'decode tok/s':>13s} {'weight MB':>10s} "
        f"{'host ms/tok':>12s}"
    )
    for r in runs:
        print(
            f"{'jaxinfer (' + r[3] + ')':34s} {r[0]:14.1f} {r[1]:13.1f} {r[2] / 1e6:10.0f} "
            f"{r[4]:12.2f}"
        )
    if hf:
        print(f"{'hf-transformers':34s} {hf[0]:14.1f} {hf[1]:13.1f}")
    for lcpp in lcpps:
        name = f"llama.cpp ({lcpp['model_type']}, t={lcpp['threads']})"
        print(f"{name:34s} {lcpp['prefill_tok_s']:14.1f} {lcpp['decode_tok_s']:13.1f}")
    print(
        f"{'roofline':34s} {'':14s} {roofline:13.1f}  ({nbytes / 1e6:.0f} MB of weights "
        f"at the measured {bandwidth / 1e9:.1f} GB/s read bandwidth)"
    )
    rows = [(r[3], r[5]) for r in runs]
    peers = [(f"llama.cpp t={lcpp['threads']}", lcpp["per_round_decode_tok_s"]) for lcpp in lcpps]
    ratios = round_ratios(rows, peers)
    if args.rounds > 1:
        print(f"decode tok/s and ratios per round ({args.rounds} rounds of {args.runs} runs):")
        for i in range(args.rounds):
            cells = [f"{name} {xs[i]:.1f}" for name, xs in rows + peers]
            cells += [f"{name} {xs[i]:.2f}" for name, xs in ratios.items()]
            print(f"  round {i + 1}: " + ", ".join(cells))
        for name, xs in ratios.items():
            print(
                f"  {name}: median {statistics.median(xs):.2f} over {len(xs)} rounds "
                f"(min {min(xs):.2f}, max {max(xs):.2f})"
            )
    print(
        json.dumps(
            {
                "bench": "generate",
                "machine": platform.machine(),
                "cpus": os.cpu_count(),
                "load_format": args.load_format,
                "prompt_len": args.prompt_len,
                "decode_tokens": args.decode_tokens,
                "runs": args.runs,
                "rounds": args.rounds,
                "jaxinfer": {
                    r[3]: {
                        "prefill_tok_s": round(r[0], 1),
                        "decode_tok_s": round(r[1], 1),
                        "weight_bytes": r[2],
                        "host_cpu_ms_per_token": round(r[4], 2),
                        "per_round_decode_tok_s": [round(x, 1) for x in r[5]],
                    }
                    for r in runs
                },
                "hf": hf and {"prefill_tok_s": round(hf[0], 1), "decode_tok_s": round(hf[1], 1)},
                "llama_cpp": [
                    {
                        **lcpp,
                        "prefill_tok_s": round(lcpp["prefill_tok_s"], 1),
                        "decode_tok_s": round(lcpp["decode_tok_s"], 1),
                        "per_round_decode_tok_s": [
                            round(x, 1) for x in lcpp["per_round_decode_tok_s"]
                        ],
                    }
                    for lcpp in lcpps
                ],
                "ratios": {
                    name: {
                        "per_round": [round(x, 3) for x in xs],
                        "median": round(statistics.median(xs), 3),
                    }
                    for name, xs in ratios.items()
                },
                "roofline": {
                    "weight_bytes": nbytes,
                    "read_gb_s": round(bandwidth / 1e9, 1),
                    "decode_tok_s": round(roofline, 1),
                },
            }
        )
    )


if __name__ == "__main__":
    main()
