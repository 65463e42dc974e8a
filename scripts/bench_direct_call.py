"""Warmed programs called directly vs through `Compiled`'s checks, alternated in one process.

    python scripts/bench_direct_call.py [--quantization int4] [--rounds 6] [--tokens 128]
                                        [--no-warmup]

One `LLM` of the default model (float32 activations, one sequence slot, warmed up; with
`--no-warmup` its jit runs each shape first, as an offline `LLM` does); each round
generates `--tokens` greedy tokens twice, once per path (`runner.direct_call.ENABLED`), in
alternating order, and checks both give the same tokens. Prints the median decode tok/s and the
engine thread's CPU time per token (`time.thread_time`) of each path, and the difference.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import _path  # noqa: F401

from jaxinfer import LLM, SamplingParams
from jaxinfer.engine.runner import direct_call

PROMPT = "The history of the city begins"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quantization", default="int4", help="int4, int8 or none")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--model", default=None, help="a checkpoint (default: the embedded model)")
    p.add_argument("--no-warmup", action="store_true", help="the jit's programs (offline LLM)")
    args = p.parse_args()
    quant = args.quantization
    llm = LLM(args.model, dtype="float32", quantization=quant, max_num_seqs=1)
    if not args.no_warmup:
        llm.engine.warmup()
    sp = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    want = llm.generate([PROMPT], sp)[0].outputs[0].token_ids
    runs: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for r in range(args.rounds):
        for direct in (True, False) if r % 2 == 0 else (False, True):
            direct_call.ENABLED = direct
            t, c = time.perf_counter(), time.thread_time()
            got = llm.generate([PROMPT], sp)[0].outputs[0].token_ids
            dt, dc = time.perf_counter() - t, time.thread_time() - c
            if got != want:
                raise SystemExit(f"tokens differ on the {'direct' if direct else 'checked'} path")
            runs[direct].append((args.tokens / dt, 1e3 * dc / args.tokens))
    med = {
        d: (statistics.median(x for x, _ in v), statistics.median(y for _, y in v))
        for d, v in runs.items()
    }
    for d, name in ((True, "direct"), (False, "checked")):
        print(f"{name:8s} {med[d][0]:7.1f} tok/s  engine thread {med[d][1]:.2f} ms CPU / token")
    print(
        f"direct - checked: {med[True][1] - med[False][1]:+.2f} ms CPU / token, "
        f"{med[True][0] / med[False][0]:.3f}x tok/s"
    )
    print(json.dumps({"quantization": args.quantization, "rounds": args.rounds, "runs": runs}))


if __name__ == "__main__":
    main()
