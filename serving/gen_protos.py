"""Regenerates the Python stubs of `serving/protos` with grpcio-tools (never edit them by hand).

    python serving/gen_protos.py            # rewrites serving/protos/jaxinfer/v1/generate_pb2*.py{,i}
    python serving/gen_protos.py --out DIR  # writes them under DIR instead (the sync test does)

1. `protoc -I serving/protos --python_out --pyi_out --grpc_python_out` on every `.proto`, so the
   descriptors are registered under their canonical names ("jaxinfer/v1/generate.proto") and the
   stubs land next to the `.proto` files.
2. protoc writes absolute imports between generated modules (`from jaxinfer.v1 import
   generate_pb2`), which would resolve to the `jaxinfer` library package; they are rewritten to
   package-relative imports (`from . import generate_pb2`), so `serving.protos.jaxinfer.v1` works
   from the repo root and when installed.

NOTE: the stubs record the grpcio-tools version that wrote them, which is why `grpcio-tools` is
pinned in pyproject.toml: a different version regenerates different bytes and fails the sync test.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

PROTO_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "protos")


def proto_files(root: str = PROTO_ROOT) -> list[str]:
    """Every `.proto` under `root`, relative to it, sorted."""
    found = []
    for folder, _, files in os.walk(root):
        found += [
            os.path.relpath(os.path.join(folder, f), root) for f in files if f.endswith(".proto")
        ]
    return sorted(p.replace(os.sep, "/") for p in found)


def _relative_imports(path: str, packages: set[str]) -> None:
    with open(path, encoding="utf-8") as f:
        text = f.read()

    def fix(m: re.Match) -> str:
        package, module = m.group(1), m.group(2)
        here = os.path.dirname(path)
        # Only sibling modules are rewritten; anything else (google.protobuf, grpc) is left alone.
        return f"from . import {module}" if package in packages and here else m.group(0)

    new = re.sub(r"^from ([\w.]+) import (\w+_pb2)\b", fix, text, flags=re.MULTILINE)
    if new != text:
        with open(path, "w", encoding="utf-8") as f:
            f.write(new)


def generate(out_dir: str = PROTO_ROOT, root: str = PROTO_ROOT) -> list[str]:
    """Writes the stubs of every proto under `root` into `out_dir`; returns the files written."""
    from grpc_tools import protoc  # build-time dependency (the `dev` extra)

    protos = proto_files(root)
    well_known = os.path.join(os.path.dirname(protoc.__file__), "_proto")
    args = [
        "protoc",
        f"-I{root}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {protos}")
    written = []
    packages = {os.path.dirname(p).replace("/", ".") for p in protos}
    for proto in protos:
        base = os.path.join(out_dir, proto[: -len(".proto")])
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            path = base + suffix
            if os.path.exists(path):
                _relative_imports(path, packages)
                written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", default=PROTO_ROOT, help="output root (default: next to the protos)")
    args = p.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
