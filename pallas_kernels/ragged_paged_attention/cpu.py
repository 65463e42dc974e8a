"""Ragged paged attention for XLA:CPU: a C++ kernel called through the XLA FFI.

The pure-JAX reference spends most of a CPU decode step in gathers and small batched dots (~2.5
GB/s of KV at 64 decodes, BENCHMARKS.md); `cpu_kernel.cc` reads each sequence's pages once,
straight from the cache, with every core of XLA's intra-op pool.

1. `library()` compiles `cpu_kernel.cc` on first use with the machine's C++ compiler (`$CXX`, else
   `c++`/`g++`) against jaxlib's FFI headers (`jax.ffi.include_dir()`), into a cache directory
   (`$JAXINFER_KERNEL_CACHE`, default `~/.cache/jaxinfer/kernels`) under a name keyed by the
   source, the headers, the flags and this CPU's instruction-set flags; the file is written
   atomically, so concurrent processes share it. It registers the handler as a custom call for
   the "cpu" platform. `available()` says whether that worked (and `unavailable_reason()` why not).
2. `ragged_paged_attention` has the reference's signature and emits the custom call; `blocks` is
   accepted for signature parity with the Pallas kernels and must be None (the kernel's tiles are
   fixed in the C++ source).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.ragged_paged_attention.reference import check_inputs

SOURCE = Path(__file__).with_name("cpu_kernel.cc")
TARGET = "jaxinfer_ragged_paged_attention_cpu"
SYMBOL = "JaxinferRaggedPagedAttention"
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fopenmp-simd",
         "-fno-math-errno")
DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def _compiler() -> str:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    raise RuntimeError("no C++ compiler found (set CXX, or install g++) to build the CPU attention kernel")


def _cpu_flags() -> str:
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


def _build(cxx: str) -> Path:
    include = Path(jax.ffi.include_dir())
    headers = sorted((include / "xla" / "ffi" / "api").glob("*.h"))
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), *(h.read_bytes() for h in headers),
                 " ".join(FLAGS).encode(), cxx.encode(), _cpu_flags().encode()):
        key.update(part)
    out = _cache_dir() / f"rpa_cpu_{key.hexdigest()[:20]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_out = Path(tmp) / out.name
        cmd = [cxx, *FLAGS, f"-I{include}", str(SOURCE), "-o", str(tmp_out)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"building the CPU attention kernel failed ({' '.join(cmd)}):\n{proc.stderr[-4000:]}")
        os.replace(tmp_out, out)  # atomic: a concurrent build of the same key wins or loses whole
    return out


@functools.cache
def library() -> ctypes.CDLL:
    """Builds (once per machine and source) and registers the kernel; raises RuntimeError if it cannot."""
    lib = ctypes.cdll.LoadLibrary(str(_build(_compiler())))
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(getattr(lib, SYMBOL)), platform="cpu")
    return lib


@functools.cache
def unavailable_reason() -> str | None:
    try:
        library()
    except (RuntimeError, OSError) as e:
        return str(e)
    return None


def available() -> bool:
    return unavailable_reason() is None


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap", "interpret", "blocks"))
def ragged_paged_attention(
    q: jax.Array,  # [T, Hq, D]
    kv_cache: jax.Array,  # [P, page_size, 2*Hkv, D]
    kv_lens: jax.Array,  # i32[S]
    page_indices: jax.Array,  # i32[S, pages_per_seq]
    cu_q_lens: jax.Array,  # i32[S+1]
    num_seqs: jax.Array,  # i32[1]
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: jax.Array | None = None,  # f32[Hq]
    interpret: bool = False,  # accepted for signature parity; the kernel always runs compiled
    blocks: None = None,
) -> jax.Array:  # [T, Hq, D]
    del interpret
    if blocks is not None:
        raise ValueError("the CPU kernel has fixed tiles: blocks must be None")
    check_inputs(q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs)
    for name, x in (("q", q), ("kv_cache", kv_cache)):
        if x.dtype not in DTYPES:
            raise ValueError(f"the CPU kernel takes float32 or bfloat16 {name}, got {x.dtype}")
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window must be positive, got {sliding_window}")
    if soft_cap is not None and soft_cap <= 0:
        raise ValueError(f"soft_cap must be positive, got {soft_cap}")
    hq = q.shape[1]
    if sinks is not None and sinks.shape != (hq,):
        raise ValueError(f"sinks must be f32[{hq}] (one per query head), got {sinks.shape}")
    library()
    sink_arr = jnp.zeros((hq,), jnp.float32) if sinks is None else sinks.astype(jnp.float32)
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype))
    return call(q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, sink_arr,
                sm_scale=np.float32(sm_scale), sliding_window=np.int64(sliding_window or 0),
                soft_cap=np.float32(soft_cap or 0.0), has_sinks=sinks is not None)
