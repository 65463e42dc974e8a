"""Speculative decoding against plain decoding, in the same run, on the default model.

    python scripts/bench_spec.py [--model PATH] [--method ngram] [--num-speculative-tokens 4]
                                 [--new-tokens 96] [--runs 3] [--batch 64] [--batch-tokens 24]

1. Two engines over the same weights: plain (async scheduling, the default) and speculative
   (`speculative_config` from the flags; draft_model needs `--draft-model PATH`). Greedy,
   prefix caching off (every run repeats its prompts).
2. Single stream, copy-heavy: chat prompts that ask the model to repeat or lightly edit a passage
   (the answer reuses long spans of the prompt, where n-gram lookup proposes well). Each run
   adds one prompt and steps until done; wall time from add to the last token. Runs alternate
   between the engines; a first pass over every prompt compiles (each prompt length and number
   of proposals has its program), the measured pass repeats them; medians over runs; the
   outputs must be identical.
3. Batch: `--batch` copy prompts at once (`--batch-tokens` each), where the back-off rule
   (`disable_by_batch_size`) turns speculation off: wall time of the whole batch, both engines.
4. Prints a table and one JSON line for BENCHMARKS.md: tokens/s, speed-ups, acceptance rate
   (accepted / proposed tokens) and mean accepted length (tokens per verifying step).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import _path  # noqa: F401

from jaxinfer import LLM, SamplingParams
from jaxinfer.engine.types import EngineStats

PASSAGES = [
    "The river town wakes before dawn. Fishermen push their boats into the grey water, the baker "
    "lights his ovens, and the first bus leaves the square at half past five. By seven the market "
    "is full of crates of apples, pears and late plums, and the old clock on the church tower "
    "strikes the hour a minute too early, as it has done for forty years.",
    "To reset the router, unplug it from the wall, wait thirty seconds, and plug it back in. When "
    "the front light turns green, open a browser and go to the setup page. Enter the password "
    "printed on the sticker under the router, choose a new network name, and save the settings. "
    "If the light stays red, hold the reset button for ten seconds and start again.",
    "Our quarterly report shows revenue of 4.2 million, up 12 percent from the same quarter last "
    "year. Costs rose 8 percent, mostly from new hires in support and engineering. The board "
    "approved the budget for the new warehouse, and construction starts in March. We expect the "
    "warehouse to cut shipping times by two days for customers in the north.",
]
INSTRUCTIONS = [
    "Repeat the following text exactly, word for word:\n\n{p}",
    "Copy this paragraph and change nothing except that every number is written in digits:\n\n{p}",
    "Rewrite the text below exactly as it is, then stop:\n\n{p}",
]


def copy_prompts(llm: LLM, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        text = INSTRUCTIONS[i % len(INSTRUCTIONS)].format(
            p=PASSAGES[(i // len(INSTRUCTIONS) + i) % len(PASSAGES)]
        )
        out.append(
            llm.tokenizer.encode_chat(
                [{"role": "user", "content": text}], add_generation_prompt=True
            )
        )
    return out


def timed(llm: LLM, prompts: list[list[int]], sp: SamplingParams, tag: str) -> tuple[float, list]:
    """Wall seconds to generate every prompt's completion; the token ids."""
    eng = llm.engine
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        eng.add_request(p, sp, request_id=f"{tag}-{i}")
    tokens: dict[str, list[int]] = {}
    while eng.has_unfinished():
        for d in eng.step():
            tokens.setdefault(d.request_id, []).extend(d.new_token_ids)
    return time.perf_counter() - start, [tokens[f"{tag}-{i}"] for i in range(len(prompts))]


def spec_numbers(before: EngineStats, after: EngineStats) -> tuple[float, float]:
    steps = after.spec_steps - before.spec_steps
    drafts = after.spec_draft_tokens - before.spec_draft_tokens
    accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
    return (accepted / drafts if drafts else 0.0), (1 + accepted / steps if steps else 0.0)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default=None)
    p.add_argument("--method", default="ngram", choices=("ngram", "draft_model"))
    p.add_argument("--draft-model", default=None, help="draft checkpoint (method draft_model)")
    p.add_argument(
        "--draft-num-layers",
        type=int,
        default=None,
        help="keep the draft's first N layers (a truncated target is a draft)",
    )
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--prompt-lookup-max", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--batch", type=int, default=64, help="0: skip the batch measurement")
    p.add_argument("--batch-tokens", type=int, default=24)
    args = p.parse_args()

    spec = {"method": args.method, "num_speculative_tokens": args.num_speculative_tokens}
    if args.method == "ngram":
        spec["prompt_lookup_max"] = args.prompt_lookup_max
    else:
        spec["model"] = args.draft_model
        if args.draft_num_layers:
            spec["draft_num_layers"] = args.draft_num_layers
    common = dict(
        max_model_len=512,
        page_size=16,
        enable_prefix_caching=False,
        max_num_seqs=max(args.batch, 1),
        max_num_batched_tokens=512,
    )
    plain = LLM(args.model, **common)
    specd = LLM(args.model, speculative_config=spec, **common)
    engines = {"plain": plain, "spec": specd}
    prompts = copy_prompts(plain, max(args.runs, 1))
    sp = SamplingParams(temperature=0.0, max_tokens=args.new_tokens)

    single = {name: [] for name in engines}  # (seconds, tokens) per run
    for measured in (False, True):  # the first pass compiles
        stats0 = specd.engine.stats()
        for run in range(args.runs):
            outs = {}
            for name, llm in engines.items():
                secs, toks = timed(llm, [prompts[run]], sp, f"s{run}{measured}")
                outs[name] = toks[0]
                if measured:
                    single[name].append((secs, len(toks[0])))
            if outs["plain"] != outs["spec"]:
                raise SystemExit(
                    f"run {run}: greedy outputs differ with speculation:\n"
                    f"{outs['plain']}\n{outs['spec']}"
                )
    rate, mean_len = spec_numbers(stats0, specd.engine.stats())
    tps = {n: statistics.median(t / s for s, t in runs) for n, runs in single.items()}

    batch = {}
    if args.batch:
        bsp = SamplingParams(temperature=0.0, max_tokens=args.batch_tokens, ignore_eos=True)
        bprompts = copy_prompts(plain, args.batch)
        for run in range(2):  # run 0 compiles
            outs = {}
            for name, llm in engines.items():
                secs, toks = timed(llm, bprompts, bsp, f"b{run}")
                outs[name] = toks
                if run:
                    batch[name] = sum(map(len, toks)) / secs
            if outs["plain"] != outs["spec"]:
                raise SystemExit("batch: greedy outputs differ with speculation")

    cores = os.cpu_count()
    print(
        f"\nspeculative decoding ({json.dumps(spec)}), {platform.machine()} x{cores} cores, "
        f"{args.runs} runs, greedy outputs identical"
    )
    print(f"  single stream, copy prompts, {args.new_tokens} new tokens max:")
    for name in engines:
        print(f"    {name:6s} {tps[name]:7.1f} tok/s")
    print(
        f"    speed-up {tps['spec'] / tps['plain']:.2f}x; acceptance rate {rate:.2f}, "
        f"mean accepted length {mean_len:.2f}"
    )
    if batch:
        print(f"  batch {args.batch} x {args.batch_tokens} tokens (speculation backs off):")
        for name in engines:
            print(f"    {name:6s} {batch[name]:7.1f} tok/s")
        print(f"    ratio {batch['spec'] / batch['plain']:.2f}x")
    print(
        json.dumps(
            {
                "bench": "spec",
                "config": spec,
                "machine": platform.machine(),
                "cpus": cores,
                "date": time.strftime("%Y-%m-%d"),
                "runs": args.runs,
                "single_tok_s": {k: round(v, 2) for k, v in tps.items()},
                "single_speedup": round(tps["spec"] / tps["plain"], 3),
                "acceptance_rate": round(rate, 3),
                "mean_accepted_length": round(mean_len, 3),
                "batch": args.batch,
                "batch_tok_s": {k: round(v, 2) for k, v in batch.items()},
                "batch_ratio": round(batch["spec"] / batch["plain"], 3) if batch else None,
            }
        )
    )


if __name__ == "__main__":
    main()
