"""Generate a completion from the command line.

python scripts/generate.py --prompt "The sea is" --max-tokens 32
python scripts/generate.py --chat --prompt "Write a haiku about the sea."
python scripts/generate.py --model path/to/model.gguf --prompt "..." --temperature 0.7 --seed 1
"""

from __future__ import annotations

import argparse
import sys
import time

import _path  # noqa: F401

from jaxinfer import LLM, SamplingParams


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model",
        default=None,
        help="GGUF file, HF dir or orbax dir (default: SmolLM2-135M-Instruct)",
    )
    p.add_argument("--prompt", required=True)
    p.add_argument(
        "--chat", action="store_true", help="wrap the prompt in the model's chat template"
    )
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    p.add_argument("--max-model-len", type=int, default=2048)
    args = p.parse_args(argv)
    try:
        sampling = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
        )
        t0 = time.perf_counter()
        llm = LLM(
            args.model,
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            max_num_seqs=1,
            max_num_batched_tokens=256,
        )
        t1 = time.perf_counter()
        if args.chat:
            out = llm.chat([{"role": "user", "content": args.prompt}], sampling)
        else:
            out = llm.generate([args.prompt], sampling)[0]
        t2 = time.perf_counter()
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out.text)
    print(
        f"[{len(out.prompt_token_ids)} prompt tokens, {len(out.token_ids)} generated, finish: "
        f"{out.finish_reason}; load {t1 - t0:.1f}s, generate {t2 - t1:.1f}s incl. compilation]",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
