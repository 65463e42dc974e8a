"""The CPU attention on the products' lingering helper vs on its caller alone, in one process.

    python scripts/bench_attention_helpers.py [--quantization int4] [--prompt-len 128]
                                              [--rounds 12] [--tokens 128]

One offline `LLM` of the default model (float32 activations, one sequence slot, the CPU kernels);
each round decodes `--tokens` greedy tokens after a `--prompt-len` token prompt twice: once with
the attention kernel handing its items to a helper the linear kernel left lingering
(`pallas_kernels/cpu_helpers.h`), once with every attention on its calling thread
(`JaxinferCpuAttentionUseLingering(0)`), in alternating order, and checks both give the same
tokens. Prints each way's median decode tok/s and ms per token, in how many rounds the helper's
way was faster, and how many attention items a helper ran per token.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time

import _path  # noqa: F401

from jaxinfer import LLM, SamplingParams
from pallas_kernels.ragged_paged_attention import cpu as attention_cpu


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quantization", default="int4", help="int4, int8 or none")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--tokens", type=int, default=128)
    args = p.parse_args()
    for name in ("prompt_len", "rounds", "tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    llm = LLM(
        None,
        dtype="float32",
        quantization=args.quantization,
        max_num_seqs=1,
        enable_prefix_caching=False,
        attention_backend="cpu",
    )
    lib = attention_cpu.library()
    use = lib.JaxinferCpuAttentionUseLingering
    use.argtypes = [ctypes.c_int]
    helped = lib.JaxinferCpuAttentionHelped
    helped.restype = ctypes.c_int64
    prompt = {"prompt_token_ids": [1000 + i for i in range(args.prompt_len)]}
    sp = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    want = llm.generate([prompt], sp)[0].outputs[0].token_ids
    runs: dict[bool, list[float]] = {True: [], False: []}
    items: dict[bool, int] = {True: 0, False: 0}
    try:
        for r in range(args.rounds):
            for on in (True, False) if r % 2 == 0 else (False, True):
                use(int(on))
                before, t = helped(), time.perf_counter()
                got = llm.generate([prompt], sp)[0].outputs[0].token_ids
                dt = time.perf_counter() - t
                if got != want:
                    raise SystemExit(f"tokens differ with helpers {'on' if on else 'off'}")
                runs[on].append(args.tokens / dt)
                items[on] += helped() - before
    finally:
        use(1)
    med = {on: statistics.median(v) for on, v in runs.items()}
    for on, name in ((True, "helper"), (False, "alone")):
        print(
            f"{name:7s} {med[on]:7.1f} tok/s  {1e3 / med[on]:6.2f} ms / token  "
            f"{items[on] / (args.rounds * args.tokens):5.1f} items a token on a helper"
        )
    wins = sum(a > b for a, b in zip(runs[True], runs[False], strict=True))
    print(
        f"helper - alone: {1e3 / med[True] - 1e3 / med[False]:+.2f} ms / token, "
        f"{med[True] / med[False]:.3f}x tok/s, faster in {wins} of {args.rounds} rounds"
    )
    print(json.dumps({**vars(args), "tok_s": {"helper": runs[True], "alone": runs[False]}}))


if __name__ == "__main__":
    main()
