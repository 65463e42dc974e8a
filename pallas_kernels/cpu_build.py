"""Compiles the C++ kernels for XLA:CPU on first use and registers them as FFI custom calls.

1. `CppKernel(source, symbol, target)` names one `.cc` file, the handler symbol it exports and the
   custom-call target JAX code emits (`more`: further (symbol, target) pairs of the same file).
2. `library()` compiles the file with the machine's C++ compiler (`$CXX`, else `c++`/`g++`/
   `clang++`) against jaxlib's FFI headers (`jax.ffi.include_dir()`) into a cache directory
   (`$JAXINFER_KERNEL_CACHE`, default `~/.cache/jaxinfer/kernels`), under a name keyed by the
   source, the headers, the flags and this CPU's instruction-set flags. The file is written
   atomically, so concurrent processes share it; a build that fails leaves `<name>.failed` with
   the compiler's message, so later processes (every server and test process on a CPU without
   the kernel's instruction set) raise it without running the compiler again. The handler is
   then registered for the "cpu" platform. `available()` says whether that worked and `unavailable_reason()` why not, so callers
   can fall back to a pure-JAX path with a reason to log.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax

FLAGS = (
    "-O3",
    "-march=native",
    "-std=c++17",
    "-shared",
    "-fPIC",
    "-fopenmp-simd",
    "-fno-math-errno",
)


SHARED = Path(__file__).resolve().parent  # headers every kernel may include (cpu_helpers.h)


def _compiler() -> str:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    raise RuntimeError("no C++ compiler found (set CXX, or install g++) to build the CPU kernels")


def cpu_flags() -> str:
    """The CPU's instruction-set flags line (`/proc/cpuinfo`), what its compiled code may use."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _cache_dir() -> Path:
    root = os.environ.get("JAXINFER_KERNEL_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "jaxinfer" / "kernels"


@dataclasses.dataclass(frozen=True)
class CppKernel:
    source: Path  # the .cc file
    symbol: str  # the handler it exports (XLA_FFI_DEFINE_HANDLER_SYMBOL)
    target: str  # the custom-call name JAX code emits
    more: tuple[tuple[str, str], ...] = ()  # further handlers of the file: (symbol, target)

    def _build(self, cxx: str) -> Path:
        include = Path(jax.ffi.include_dir())
        headers = sorted((include / "xla" / "ffi" / "api").glob("*.h"))
        key = hashlib.sha256()
        # NOTE: the headers beside the source are parts of it (cpu_kernel_int4.h), and so are
        # the kernels' shared ones here (cpu_helpers.h, included through -I)
        local = sorted(self.source.parent.glob("*.h")) + sorted(SHARED.glob("*.h"))
        for part in (
            self.source.read_bytes(),
            *(h.read_bytes() for h in local),
            *(h.read_bytes() for h in headers),
            " ".join(FLAGS).encode(),
            cxx.encode(),
            cpu_flags().encode(),
        ):
            key.update(part)
        out = _cache_dir() / f"{self.source.stem}_{key.hexdigest()[:20]}.so"
        failed = out.with_suffix(".failed")
        if out.exists():
            return out
        if failed.exists():  # NOTE: same key, same result: no compiler run per process
            raise RuntimeError(failed.read_text())
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            tmp_out = Path(tmp) / out.name
            cmd = [cxx, *FLAGS, f"-I{include}", f"-I{SHARED}", str(self.source), "-o", str(tmp_out)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                why = (
                    f"building {self.source.name} failed ({' '.join(cmd)}):\n{proc.stderr[-4000:]}"
                )
                (Path(tmp) / failed.name).write_text(why)
                os.replace(Path(tmp) / failed.name, failed)
                raise RuntimeError(why)
            os.replace(
                tmp_out, out
            )  # atomic: a concurrent build of the same key wins or loses whole
        return out

    @functools.cache  # noqa: B019 (instances are module-level constants)
    def library(self) -> ctypes.CDLL:
        """Builds (once per machine and source) and registers the kernel; raises RuntimeError if it cannot."""
        lib = ctypes.cdll.LoadLibrary(str(self._build(_compiler())))
        for symbol, target in ((self.symbol, self.target), *self.more):
            jax.ffi.register_ffi_target(
                target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu"
            )
        return lib

    @functools.cache  # noqa: B019
    def unavailable_reason(self) -> str | None:
        try:
            self.library()
        except (RuntimeError, OSError) as e:
            return str(e)
        return None

    def available(self) -> bool:
        return self.unavailable_reason() is None
