"""Offline throughput: N requests submitted at once, ShareGPT-like lengths, HF static batching as peer.

    python scripts/bench_offline.py [--num-requests 256] [--max-num-seqs 64] [--hf-requests 64]
                                    [--model PATH] [--load-format dummy]

1. Lengths: prompt and output lengths drawn from log-normal distributions shaped like ShareGPT
   conversations (fixed seed), clipped to the context; prompts are random token ids and every
   request generates exactly its output length (`ignore_eos`).
2. jaxinfer: one `LLMEngine`, warmed up (every bucket compiled) before the clock starts; all
   requests added at t=0, then `step()` until done. TTFT = time of a request's first token.
3. HF transformers (when installed): `generate` with static, left-padded batches of 8 and 32 over
   the first `--hf-requests` requests (greedy, `min_new_tokens = max_new_tokens` = the batch's
   longest output, which is what static batching costs); output tok/s counts only the tokens each
   request asked for.
`--load-format dummy`: random weights made on the device from `--model`'s config.json (+ tokenizer),
any architecture without its checkpoint; the HF peer is skipped then.
Prints a table and one JSON line for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import _path  # noqa: F401
import numpy as np
from _hf_peer import hf_model_from_gguf

from jaxinfer.config import EngineConfig
from jaxinfer.engine.engine import LLMEngine
from jaxinfer.loader import load_model
from jaxinfer.sampling_params import SamplingParams


def sharegpt_like(n: int, seed: int, max_len: int) -> list[tuple[int, int]]:
    rng = np.random.default_rng(seed)
    prompt = np.clip(rng.lognormal(mean=4.6, sigma=0.9, size=n), 4, max_len // 2).astype(int)
    output = np.clip(rng.lognormal(mean=4.8, sigma=0.7, size=n), 4, max_len // 2).astype(int)
    return list(zip(prompt.tolist(), output.tolist()))


def run_jaxinfer(args, model, workload, prompts):
    engine = LLMEngine(
        model,
        EngineConfig(
            dtype=model.dtype,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            page_size=16,
            async_scheduling=not args.no_async_scheduling,
        ),
        linear_backend=args.linear_backend,
    )
    t = time.perf_counter()
    programs = engine.runner.warmup()
    warmup_s = time.perf_counter() - t
    start = time.perf_counter()
    first: dict[str, float] = {}
    for i, ((_, out_len), ids) in enumerate(zip(workload, prompts)):
        engine.add_request(
            ids,
            SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True),
            request_id=str(i),
        )
    out_tokens = 0
    decode_steps = []  # (seconds, tokens) of steps that only decoded, at full concurrency
    while engine.has_unfinished():
        t = time.perf_counter()
        deltas = engine.step()
        step_s = time.perf_counter() - t
        n = sum(len(d.new_token_ids) for d in deltas)
        if n >= args.max_num_seqs and engine.scheduler.num_waiting == 0 and len(deltas) == n:
            decode_steps.append((step_s, n))
        for d in deltas:
            out_tokens += len(d.new_token_ids)
            if d.new_token_ids and d.request_id not in first:
                first[d.request_id] = time.perf_counter() - start
    elapsed = time.perf_counter() - start
    full_decode = (
        sum(n for _, n in decode_steps) / sum(s for s, _ in decode_steps) if decode_steps else None
    )
    ttft = np.array(list(first.values()))
    total = out_tokens + sum(p for p, _ in workload)
    return {
        "requests_s": len(workload) / elapsed,
        "output_tok_s": out_tokens / elapsed,
        "total_tok_s": total / elapsed,
        "ttft_mean_s": float(ttft.mean()),
        "ttft_p99_s": float(np.percentile(ttft, 99)),
        "elapsed_s": elapsed,
        "warmup_s": warmup_s,
        "programs": programs,
        "decode_tok_s_at_max_concurrency": full_decode,
        "decode_steps_measured": len(decode_steps),
    }


def run_hf(model_path, workload, prompts, batch):
    loaded = hf_model_from_gguf(model_path)
    if loaded is None:
        return None
    import torch

    model, hf = loaded
    pad = hf.get("pad_token_id") or 0
    start = time.perf_counter()
    useful = 0
    with torch.inference_mode():
        for i in range(0, len(workload), batch):
            chunk = list(range(i, min(i + batch, len(workload))))
            longest = max(len(prompts[j]) for j in chunk)
            ids = torch.full((len(chunk), longest), pad, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for r, j in enumerate(chunk):  # left padding
                ids[r, longest - len(prompts[j]) :] = torch.tensor(prompts[j])
                mask[r, longest - len(prompts[j]) :] = 1
            new = max(workload[j][1] for j in chunk)
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=new,
                min_new_tokens=new,
                pad_token_id=pad,
            )
            useful += sum(workload[j][1] for j in chunk)
    elapsed = time.perf_counter() - start
    return {
        "output_tok_s": useful / elapsed,
        "requests_s": len(workload) / elapsed,
        "elapsed_s": elapsed,
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default=None)
    p.add_argument(
        "--load-format",
        default="auto",
        choices=("auto", "dummy"),
        help="'dummy': random weights from --model's config.json (no HF peer)",
    )
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--hf-requests", type=int, default=64, help="requests given to HF (0 = skip)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--prompt-len", type=int, default=None, help="fixed prompt length (decode study)"
    )
    p.add_argument(
        "--output-len", type=int, default=None, help="fixed output length (decode study)"
    )
    p.add_argument(
        "--linear-backend",
        default=None,
        choices=("auto", "xla", "cpu"),
        help="jaxinfer's dense-product backend (default: auto)",
    )
    p.add_argument(
        "--no-async-scheduling",
        action="store_true",
        help="jaxinfer waits for each step's tokens before scheduling the next",
    )
    args = p.parse_args()
    model = load_model(args.model, load_format=args.load_format)
    workload = sharegpt_like(args.num_requests, args.seed, args.max_model_len)
    if args.prompt_len or args.output_len:
        workload = [(args.prompt_len or p, args.output_len or o) for p, o in workload]
    rng = np.random.default_rng(args.seed + 1)
    prompts = [rng.integers(100, min(40000, model.cfg.vocab_size), n).tolist() for n, _ in workload]
    ours = run_jaxinfer(args, model, workload, prompts)
    print(
        f"jaxinfer: {ours['requests_s']:.2f} req/s, {ours['output_tok_s']:.1f} output tok/s, "
        f"{ours['total_tok_s']:.1f} total tok/s, TTFT mean {ours['ttft_mean_s']:.2f}s "
        f"p99 {ours['ttft_p99_s']:.2f}s ({ours['programs']} programs, warmup {ours['warmup_s']:.0f}s)"
    )
    if ours["decode_tok_s_at_max_concurrency"]:
        print(
            f"  decode at {args.max_num_seqs} concurrent sequences: "
            f"{ours['decode_tok_s_at_max_concurrency']:.1f} output tok/s "
            f"({ours['decode_steps_measured']} pure-decode steps)"
        )
    hf = {}
    if args.hf_requests and model.source == "gguf":
        for batch in (8, 32):
            r = run_hf(model.path, workload[: args.hf_requests], prompts[: args.hf_requests], batch)
            if r:
                hf[f"batch{batch}"] = r
                print(
                    f"hf static batch {batch}: {r['output_tok_s']:.1f} output tok/s "
                    f"({args.hf_requests} requests)"
                )
    print(
        json.dumps(
            {
                "bench": "offline",
                "machine": platform.machine(),
                "cpus": os.cpu_count(),
                "num_requests": args.num_requests,
                "max_num_seqs": args.max_num_seqs,
                "linear_backend": args.linear_backend or "auto",
                "async_scheduling": not args.no_async_scheduling,
                "jaxinfer": ours,
                "hf": hf,
            }
        )
    )


if __name__ == "__main__":
    main()
