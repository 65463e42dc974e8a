"""Structured output's cost per engine step: N concurrent decoding rows, unconstrained vs every
row under a grammar (a regex, a JSON schema), on the same model, prompts and lengths.

    python scripts/bench_structured.py                      # default model, 64 rows, 32 steps
    python scripts/bench_structured.py --rows 64 --steps 32 --repeats 5

1. N prompts of `--prompt-len` random token ids prefill in one step; then every row decodes
   `--steps` tokens at temperature 1. Unconstrained rows ignore EOS; constrained rows follow the
   regex `[a-z ]{4096}` or a JSON schema (an array of at least 512 {name, age} objects): no row
   can finish within the steps, so every run computes exactly N x steps tokens.
2. Runs (engine steps asynchronous, the default): "unconstrained"; "regex" and "json" (each step
   launches the forward, fills the masks while it runs, then the sampler program); and with
   `--fused` also "regex, fused sync" (the masks filled before one fused program, synchronous
   steps: how structured output ran before the split). Each run is done once to compile, then
   `--repeats` rounds run every run once in turn (interleaved, so load drifts hit all alike); a
   run's figure is the median over rounds of its mean decode-step wall time.
3. Also reported: the host time of one N-row mask fill (`StructuredOutputs.fill`, llguidance's
   thread pool) for each grammar, measured alone, and one JSON line for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import time

import _path  # noqa: F401
import numpy as np

from jaxinfer import LLM, SamplingParams, StructuredOutputsParams

REGEX = "[a-z ]{4096}"
SCHEMA = {
    "type": "array",
    "minItems": 512,
    "items": {
        "type": "object",
        "required": ["name", "age"],
        "additionalProperties": False,
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    },
}


def decode_step_times(llm: LLM, prompts: list[list[int]], sp: SamplingParams) -> list[float]:
    """Wall time of each engine step in which every row decodes."""
    engine = llm.engine
    for i, ids in enumerate(prompts):
        engine.add_request(ids, sp, request_id=f"b{time.perf_counter_ns()}-{i}")
    times, generated = [], 0
    while engine.has_unfinished():
        t0 = time.perf_counter()
        deltas = engine.step()
        dt = time.perf_counter() - t0
        new = sum(len(d.new_token_ids) for d in deltas)
        generated += new
        if new == len(prompts) and generated > len(prompts):  # past the first (prefill) token
            times.append(dt)
    return times


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default=None)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--fused", action="store_true", help="also the fused synchronous path")
    p.add_argument(
        "--runs",
        default=None,
        help="comma-separated subset of the runs (with "
        "'unconstrained' first): e.g. unconstrained,regex",
    )
    args = p.parse_args()

    llm = LLM(
        args.model,
        max_num_seqs=args.rows,
        max_model_len=256,
        max_num_batched_tokens=max(256, args.rows * args.prompt_len),
    )
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 20000, args.prompt_len).tolist() for _ in range(args.rows)]
    grammars = {
        "regex": StructuredOutputsParams(regex=REGEX),
        "json": StructuredOutputsParams(json=SCHEMA),
    }

    def params(so: StructuredOutputsParams | None) -> SamplingParams:
        return SamplingParams(
            max_tokens=args.steps,
            temperature=1.0,
            seed=1,
            ignore_eos=so is None,
            structured_outputs=so,
        )

    # name -> (sampling params, split steps and async scheduling)
    runs = {
        "unconstrained": (params(None), True),
        "regex": (params(grammars["regex"]), True),
        "json": (params(grammars["json"]), True),
    }
    if args.fused:
        runs["regex, fused sync"] = (params(grammars["regex"]), False)
    if args.runs:
        names = args.runs.split(",")
        if names[0] != "unconstrained" or not set(names) <= set(runs):
            raise SystemExit(f"--runs: 'unconstrained' first, then any of {sorted(runs)}")
        runs = {name: runs[name] for name in names}
    core = llm.engine.core
    config, runner = core.config, core.runner

    def run(name: str) -> float:
        sp, split = runs[name]
        core.config = dataclasses.replace(config, async_scheduling=split)
        runner.split_sampling = split
        try:
            return statistics.mean(decode_step_times(llm, prompts, sp))
        finally:
            core.config, runner.split_sampling = config, True

    for name in runs:
        run(name)  # compile
    rounds: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name in runs:
            rounds[name].append(run(name))
    results = {name: statistics.median(r) for name, r in rounds.items()}
    for name, r in rounds.items():
        ratio = results[name] / results["unconstrained"]
        print(
            f"{name:20s} decode step {results[name] * 1e3:8.2f} ms  x{ratio:.3f} "
            f"(rounds: {', '.join(f'{x * 1e3:.1f}' for x in r)})"
        )

    so = core.structured
    fill_ms = {}
    for g, constraint in grammars.items():
        ids = [f"fill-{g}{i}" for i in range(args.rows)]
        for rid in ids:
            so.add(rid, constraint)
        so.fill(ids)
        fills = []
        for _ in range(20):
            t0 = time.perf_counter()
            so.fill(ids)
            fills.append(time.perf_counter() - t0)
        for rid in ids:
            so.remove(rid)
        fill_ms[g] = statistics.median(fills) * 1e3
    print(
        f"{args.rows}-row mask fill alone: "
        + ", ".join(f"{g} {ms:.2f} ms" for g, ms in fill_ms.items())
    )
    print(
        json.dumps(
            {
                "bench": "structured",
                "machine": platform.machine(),
                "cpus": os.cpu_count(),
                "load": os.getloadavg()[0],
                "model": llm.model.name,
                "rows": args.rows,
                "steps": args.steps,
                "repeats": args.repeats,
                "step_ms": {k: v * 1e3 for k, v in results.items()},
                "ratio": {k: v / results["unconstrained"] for k, v in results.items()},
                "mask_fill_ms": fill_ms,
            }
        )
    )


if __name__ == "__main__":
    main()
