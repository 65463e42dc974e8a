"""Host time of the runner's input preparation (`StepInputBuilder.prepare`) per decode step.

    python scripts/bench_prepare.py [--seqs 1 64 256] [--prompt-len 128] [--steps 200]

1. The runner's step-input builder alone (`jaxinfer.engine.runner.step_inputs`: its persistent
   input batch and bucket plan, SmolLM2's vocabulary size for the bitmask width), sized for the
   largest `--seqs`; no model, nothing compiled, nothing on a device.
2. For each batch size N: N requests (half seeded at temperature 0.8, half greedy) are admitted by
   the real `Scheduler` and prefilled on paper (the scheduler is told every token was sampled).
3. Then `--steps` decode steps of schedule -> `prepare` -> update, timing `prepare` (and
   `prepare` plus packing its arrays into the one-transfer buffers, which `run` does next).
Prints p50/p99 milliseconds per step for each N, and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import _path  # noqa: F401
import numpy as np

from jaxinfer.engine.page_allocator import PageAllocator
from jaxinfer.engine.request import Request
from jaxinfer.engine.runner.buckets import Buckets
from jaxinfer.engine.runner.input_batch import InputBatch
from jaxinfer.engine.runner.programs import pack
from jaxinfer.engine.runner.step_inputs import StepInputBuilder
from jaxinfer.engine.scheduler import Scheduler
from jaxinfer.engine.types import RunnerOutput
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.structured import bitmask_width

VOCAB_SIZE = 49152  # SmolLM2's


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=2048)
    return p.parse_args(argv)


def bench(
    inputs: StepInputBuilder, num_pages: int, n: int, args: argparse.Namespace
) -> dict[str, float]:
    page_size = args.page_size
    alloc = PageAllocator(num_pages, page_size, enable_prefix_caching=False)
    sched = Scheduler(
        alloc,
        max_num_seqs=inputs.max_num_seqs,
        max_num_batched_tokens=max(n * args.prompt_len, n),
        max_model_len=args.max_model_len,
    )
    rng = np.random.default_rng(0)
    for i in range(n):
        sp = (
            SamplingParams(temperature=0.8, seed=i, max_tokens=args.steps + 8, ignore_eos=True)
            if i % 2
            else SamplingParams(temperature=0.0, max_tokens=args.steps + 8, ignore_eos=True)
        )
        sched.add_request(
            Request(f"b{n}-{i}", rng.integers(100, 49152, args.prompt_len).tolist(), sp)
        )

    def fake(out):
        return RunnerOutput({s.request.request_id: 7 for s in out.scheduled if s.sample})

    out = sched.schedule()  # the whole prefill at once
    inputs.prepare(out)
    sched.update(out, fake(out))
    times = []
    for _ in range(args.steps):
        out = sched.schedule()
        t = time.perf_counter()
        prepared = inputs.prepare(out)
        t1 = time.perf_counter()
        pack(prepared.inputs)
        times.append((t1 - t, time.perf_counter() - t))
        sched.update(out, fake(out))
    for rid in list(sched._requests):
        sched.abort(rid)
    inputs.prepare(sched.schedule())  # releases the rows
    ms = np.array(times) * 1e3
    return {
        "p50_ms": round(float(np.percentile(ms[:, 0], 50)), 3),
        "p99_ms": round(float(np.percentile(ms[:, 0], 99)), 3),
        "with_pack_p50_ms": round(float(np.percentile(ms[:, 1], 50)), 3),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    top = max(args.seqs)
    pages_per_seq = -(-args.max_model_len // args.page_size)
    buckets = Buckets(
        max_num_batched_tokens=max(top * args.prompt_len, top),
        pages_per_seq=pages_per_seq,
        seqs_per_replica=top,
    )
    inputs = StepInputBuilder(
        InputBatch(top, pages_per_seq),
        buckets,
        page_size=args.page_size,
        bitmask_width=bitmask_width(VOCAB_SIZE),
    )
    results = {}
    for n in args.seqs:
        results[n] = r = bench(inputs, top * pages_per_seq + 1, n, args)
        print(
            f"{n:4d} seqs: prepare p50 {r['p50_ms']:.3f} ms  p99 {r['p99_ms']:.3f} ms  "
            f"(+ packing the transfer: p50 {r['with_pack_p50_ms']:.3f} ms)"
        )
    print(
        json.dumps(
            {
                "bench": "prepare",
                "machine": platform.processor() or platform.machine(),
                "prompt_len": args.prompt_len,
                "max_model_len": args.max_model_len,
                "results": results,
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
