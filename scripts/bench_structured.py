"""Structured output's cost per engine step: N concurrent decoding rows, unconstrained vs every
row under a grammar, on the same model, prompts and lengths.

    python scripts/bench_structured.py                      # default model, 64 rows, 32 steps
    python scripts/bench_structured.py --rows 64 --steps 32 --repeats 3

1. N prompts of `--prompt-len` random token ids prefill in one step; then every row decodes
   `--steps` tokens. Unconstrained rows ignore EOS; constrained rows follow the regex
   `[a-z ]{4096}` (lowercase words: no row can finish or be forced to EOS within the steps), so
   both runs compute exactly N x steps tokens.
2. Each run is done once to compile its programs, then `--repeats` times measured: the mean
   wall time of the decode steps (every row decoding). Unconstrained steps use async scheduling
   (the default), and once more synchronous steps; constrained steps are always synchronous
   (the mask needs the previous token), so the two ratios split structured output's cost into
   the lost overlap and the masks themselves.
3. Also reported: the host time of one 64-row mask fill (`StructuredOutputs.fill`, llguidance's
   thread pool) measured alone, and one JSON line for BENCHMARKS.md.
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
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()

    llm = LLM(args.model, max_num_seqs=args.rows, max_model_len=256,
              max_num_batched_tokens=max(256, args.rows * args.prompt_len))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 20000, args.prompt_len).tolist() for _ in range(args.rows)]
    free = SamplingParams(max_tokens=args.steps, temperature=1.0, seed=1, ignore_eos=True)
    bound = SamplingParams(max_tokens=args.steps, temperature=1.0, seed=1,
                           structured_outputs=StructuredOutputsParams(regex=REGEX))
    results = {}
    core = llm.engine.core
    async_config = core.config
    for name, sp, sync in (("unconstrained", free, False), ("unconstrained, sync", free, True),
                           ("constrained", bound, False)):
        # NOTE: constrained steps are synchronous whatever the config; "sync" turns async
        # scheduling off for unconstrained steps too, to split the cost in two.
        core.config = dataclasses.replace(async_config, async_scheduling=not sync)
        decode_step_times(llm, prompts, sp)  # compile
        runs = [statistics.mean(decode_step_times(llm, prompts, sp)) for _ in range(args.repeats)]
        results[name] = min(runs)
        print(f"{name:20s} decode step {results[name] * 1e3:8.2f} ms "
              f"(runs: {', '.join(f'{r * 1e3:.2f}' for r in runs)})")
    core.config = async_config
    so = llm.engine.core.structured
    for i in range(args.rows):
        so.add(f"fill{i}", StructuredOutputsParams(regex=REGEX))
    ids = [f"fill{i}" for i in range(args.rows)]
    so.fill(ids)
    fills = []
    for _ in range(20):
        t0 = time.perf_counter()
        so.fill(ids)
        fills.append(time.perf_counter() - t0)
    for rid in ids:
        so.remove(rid)
    ratio = results["constrained"] / results["unconstrained"]
    sync_ratio = results["constrained"] / results["unconstrained, sync"]
    fill_ms = statistics.median(fills) * 1e3
    print(f"constrained / unconstrained step time: {ratio:.3f} ({(ratio - 1) * 100:+.1f}%); vs "
          f"unconstrained synchronous steps {sync_ratio:.3f}; {args.rows}-row mask fill alone "
          f"{fill_ms:.2f} ms")
    print(json.dumps({"bench": "structured", "machine": platform.machine(), "cpus": os.cpu_count(),
                      "model": llm.model.name, "rows": args.rows, "steps": args.steps,
                      "unconstrained_step_ms": results["unconstrained"] * 1e3,
                      "unconstrained_sync_step_ms": results["unconstrained, sync"] * 1e3,
                      "constrained_step_ms": results["constrained"] * 1e3, "ratio": ratio,
                      "ratio_vs_sync": sync_ratio,
                      "mask_fill_ms": fill_ms}))


if __name__ == "__main__":
    main()
