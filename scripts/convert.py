"""Convert a Hugging Face dir or a GGUF file into a jaxinfer orbax checkpoint dir.

    python scripts/convert.py SRC DST [--dtype float32|bfloat16] [--quantization int8|fp8] [--force]

1. Parse the arguments (SRC: a HF model dir or a `.gguf` file; DST: the checkpoint dir).
2. Run `jaxinfer.convert.convert`, which writes DST/params, DST/config.json, the tokenizer and
   DST/jaxinfer.json (the layout is in that module's docstring).
3. Print where the checkpoint is; a bad source or destination prints the error, exit status 1.
   `LLM(DST)` / `load_model(DST)` then load it.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxinfer.convert import convert  # noqa: E402
from jaxinfer.params import DTYPES  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", metavar="SRC", help="Hugging Face model dir or .gguf file")
    parser.add_argument("dst", metavar="DST", help="orbax checkpoint dir to write")
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=None,
        help="dtype the params are stored in (default: float32, lossless)",
    )
    parser.add_argument(
        "--quantization",
        choices=["int8", "fp8"],
        default=None,
        help="store the linear weights and the embedding quantized (loads back quantized)",
    )
    parser.add_argument(
        "--force", action="store_true", help="replace the checkpoint in a non-empty DST"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        dst = convert(
            args.src, args.dst, args.dtype, force=args.force, quantization=args.quantization
        )
    except (OSError, ValueError) as e:  # CheckpointError, TokenizerError, UnsupportedConfigError
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
