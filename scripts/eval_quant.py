"""Accuracy of each weight quantization against the unquantized model, on the same prompts.

    python scripts/eval_quant.py [--model PATH] [--formats int8,fp8,int4] [--tokens 32] [--markdown]
                                 [--max-num-seqs 1]

1. One `LLM` per format (`none` first: the reference, in the loader's default dtype), all loaded
   from the same source (default: the embedded SmolLM2-135M-Instruct GGUF).
2. Greedy agreement: each of `PROMPTS` (12, varied: facts, code, arithmetic, lists, dialogue,
   other languages) generates `--tokens` greedy tokens; a prompt agrees at n when its first n
   tokens equal the reference's (n = 8 and all of them).
3. Logprob drift: the reference's continuation is fed back to every format as a prompt
   (`prompt_logprobs`), so each format scores the same tokens; drift is |logprob - reference
   logprob| per token, mean and max over every continuation token of every prompt.
4. Perplexity: exp(-mean prompt logprob) of `TEXT` (a fixed paragraph) under each format.
5. Prints one row per format (and, with `--markdown`, the table for BENCHMARKS.md) plus a JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time

import _path  # noqa: F401
import numpy as np

from jaxinfer import LLM, SamplingParams
from jaxinfer.params import num_bytes

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "Q: What is 17 times 23?\nA:",
    "List three primary colors:",
    "The chemical symbol for gold is",
    "Translate to French: Good morning, how are you?",
    "import numpy as np\n\n# compute the mean of an array\n",
    "User: Can you recommend a good book about space?\nAssistant:",
    "The three laws of thermodynamics state that",
    "SELECT name, age FROM users WHERE",
    "In 1969, Neil Armstrong",
]
TEXT = (
    "The quick brown fox jumps over the lazy dog. Language models predict the next token from "
    "the ones before it, and quantization stores their weights in fewer bits so that each "
    "decoding step reads less memory. A good quantization changes the predictions very little: "
    "the text below the weights should read the same, and its perplexity should barely move. "
    "Paris is the capital of France, and the Seine flows through it on its way to the sea."
)


def _chosen_logprobs(out) -> list[float]:
    """Logprob of each prompt token after the first (prompt_logprobs[0] is None)."""
    return [lp[tok] for tok, lp in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:])]


def evaluate(llm: LLM, tokens: int, ref_continuations: list[list[int]] | None):
    greedy = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    outs = llm.generate(PROMPTS, greedy)
    conts = [o.token_ids for o in outs]
    score = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    lps = None
    if ref_continuations is not None:
        prompts = [llm.tokenizer.encode(p) + c for p, c in zip(PROMPTS, ref_continuations)]
        scored = llm.generate(prompts, score)
        lps = [_chosen_logprobs(o)[-len(c) :] for o, c in zip(scored, ref_continuations)]
    text = llm.generate(TEXT, score)[0]
    ppl = math.exp(-float(np.mean(_chosen_logprobs(text))))
    return conts, lps, ppl


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
    p.add_argument(
        "--formats",
        default="int8,fp8,int4",
        help="comma-separated format names: int8, fp8, int4 (GGUF Q4_0 / Q4_1: kept in its bits), "
        "int4-g128 (GGUF: requantized to groups of 128), int4-sym, ...",
    )
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--markdown", action="store_true", help="also print the BENCHMARKS.md table")
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=len(PROMPTS),
        help="sequences per step (default: every prompt at once); 1 decodes each prompt alone, "
        "as single-stream serving does (on a CPU: through the linear kernel's few-row path)",
    )
    args = p.parse_args()
    formats = ["none", *[f for f in args.formats.split(",") if f]]
    common = dict(
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_model_len=256,
        max_num_batched_tokens=256,
    )
    rows = []
    ref_conts = ref_lps = None
    for fmt in formats:
        start = time.perf_counter()
        llm = LLM(args.model, quantization=fmt, **common)
        weight_bytes = num_bytes(llm.engine.runner.params)  # 4-bit leaves: 2 values a byte
        conts, lps, ppl = evaluate(llm, args.tokens, ref_conts)
        if ref_conts is None:
            ref_conts, ref_weight_bytes = conts, weight_bytes
            _, ref_lps, _ = evaluate(llm, args.tokens, ref_conts)
            lps = ref_lps
        drift = np.concatenate(
            [np.abs(np.asarray(a) - np.asarray(b)) for a, b in zip(lps, ref_lps)]
        )
        rows.append(
            {
                "format": fmt,
                "weight_bytes": weight_bytes,
                "bytes_vs_none": round(weight_bytes / ref_weight_bytes, 3),
                "agree_first8": sum(c[:8] == r[:8] for c, r in zip(conts, ref_conts)),
                "agree_all": sum(c == r for c, r in zip(conts, ref_conts)),
                "prompts": len(PROMPTS),
                "logprob_drift_mean": round(float(drift.mean()), 4),
                "logprob_drift_max": round(float(drift.max()), 4),
                "perplexity": round(ppl, 3),
                "seconds": round(time.perf_counter() - start, 1),
            }
        )
        del llm
    head = (
        f"{'format':8s} {'MB':>7s} {'x none':>7s} {'first 8 agree':>14s} "
        f"{f'all {args.tokens} agree':>14s} {'drift mean':>11s} {'drift max':>10s} {'ppl':>8s}"
    )
    print(head)
    for r in rows:
        print(
            f"{r['format']:8s} {r['weight_bytes'] / 1e6:7.0f} {r['bytes_vs_none']:7.3f} "
            f"{r['agree_first8']:>8d}/{r['prompts']:<5d} {r['agree_all']:>8d}/{r['prompts']:<5d} "
            f"{r['logprob_drift_mean']:11.4f} {r['logprob_drift_max']:10.4f} {r['perplexity']:8.3f}"
        )
    if args.markdown:
        print(
            f"\n| format | weight MB | x none | greedy first 8 equal | all {args.tokens} equal | "
            "logprob drift mean | max | perplexity |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(
                f"| {r['format']} | {r['weight_bytes'] / 1e6:.0f} | {r['bytes_vs_none']:.3f} | "
                f"{r['agree_first8']}/{r['prompts']} | {r['agree_all']}/{r['prompts']} | "
                f"{r['logprob_drift_mean']:.4f} | {r['logprob_drift_max']:.4f} | {r['perplexity']:.3f} |"
            )
    print(
        json.dumps(
            {
                "bench": "eval_quant",
                "model": args.model or "default",
                "machine": platform.machine(),
                "cpus": os.cpu_count(),
                "tokens": args.tokens,
                "rows": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
