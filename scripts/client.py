"""Stream a completion from a running jaxinfer server (scripts/serve.py), printing tokens as they come.

python scripts/client.py --prompt "The sea is" --max-tokens 32
python scripts/client.py --chat "Write a haiku about the sea." --temperature 0.7 --seed 1
python scripts/client.py --info                  # the served model and the engine's capacity
"""

from __future__ import annotations

import argparse
import sys
import time

import _path  # noqa: F401
import grpc

from serving.client import GenerateClient
from serving.protos.jaxinfer.v1 import generate_pb2 as pb


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="plain-text prompt")
    src.add_argument("--chat", help="a user message, rendered with the model's chat template")
    src.add_argument("--info", action="store_true", help="print GetModelInfo and exit")
    p.add_argument("--system", default=None, help="system message for --chat")
    p.add_argument("--host", default="localhost")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=None, help="server default 1.0; 0 = greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--repetition-penalty", type=float, default=None)
    p.add_argument("--frequency-penalty", type=float, default=None)
    p.add_argument("--presence-penalty", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--n", type=int, default=None, help="samples (printed when each finishes)")
    p.add_argument("--priority", type=int, default=None, help="lower is served first")
    args = p.parse_args(argv)

    client = GenerateClient(f"{args.host}:{args.port}")
    try:
        if args.info:
            print(client.model_info())
            return 0
        if args.chat is not None:
            prompt = ([{"role": "system", "content": args.system}] if args.system else []) + [
                {"role": "user", "content": args.chat}
            ]
        else:
            prompt = args.prompt
        sampling = dict(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            min_p=args.min_p,
            repetition_penalty=args.repetition_penalty,
            frequency_penalty=args.frequency_penalty,
            presence_penalty=args.presence_penalty,
            seed=args.seed,
            stop=args.stop,
            ignore_eos=args.ignore_eos or None,
            n=args.n,
        )
        start = time.perf_counter()
        first = None
        texts: dict[int, str] = {}
        tokens = 0
        last: dict[int, pb.GenerateResponse] = {}
        streaming = (args.n or 1) == 1
        for msg in client.generate(
            prompt, timeout=args.timeout, priority=args.priority, **sampling
        ):
            if msg.token_ids and first is None:
                first = time.perf_counter() - start
            tokens += len(msg.token_ids)
            texts[msg.index] = texts.get(msg.index, "") + msg.text
            if streaming:
                print(msg.text, end="", flush=True)
            if msg.finish_reason:
                last[msg.index] = msg
                if not streaming:
                    print(f"--- sample {msg.index} ---\n{texts[msg.index]}", flush=True)
        elapsed = time.perf_counter() - start
        if streaming:
            print()
        for i, msg in sorted(last.items()):
            reason = pb.GenerateResponse.FinishReason.Name(msg.finish_reason)
            u = msg.usage
            print(
                f"[sample {i}: {reason}; {u.prompt_tokens} prompt tokens ({u.cached_prompt_tokens} "
                f"cached), {u.completion_tokens} generated]",
                file=sys.stderr,
            )
        rate = (tokens - 1) / (elapsed - first) if first is not None and elapsed > first else 0.0
        print(
            f"[TTFT {first or 0:.3f}s, {elapsed:.2f}s total, {rate:.1f} tok/s after the first]",
            file=sys.stderr,
        )
        return 0
    except grpc.RpcError as e:
        print(f"\nerror: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    finally:
        client.close()


if __name__ == "__main__":
    sys.exit(main())
