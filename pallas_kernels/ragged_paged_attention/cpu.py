"""Ragged paged attention for XLA:CPU: a C++ kernel called through the XLA FFI.

The pure-JAX reference spends most of a CPU decode step in gathers and small batched dots (~2.5
GB/s of KV at 64 decodes, BENCHMARKS.md); `cpu_kernel.cc` reads each sequence's pages once,
straight from the cache, with every core of XLA's intra-op pool.

1. `KERNEL` (`pallas_kernels.cpu_build`) compiles `cpu_kernel.cc` on first use with the machine's
   C++ compiler against jaxlib's FFI headers and registers it as a custom call for the "cpu"
   platform. `available()` says whether that worked (and `unavailable_reason()` why not);
   `library()` also points it at the linear kernel's lingering helpers (`cpu_helpers.h`).
2. `ragged_paged_attention` has the reference's signature and emits the custom call (a float32
   or bfloat16 cache, or an fp8 `reference.Fp8KVCache`; `causal_bound` as the reference's: an
   image token sees up to its image's end); `blocks` is
   accepted for signature parity with the Pallas kernels and must be None (the kernel's tiles are
   fixed in the C++ source).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import paged_common as pc
from pallas_kernels.cpu_build import CppKernel
from pallas_kernels.linear import cpu as linear_cpu
from pallas_kernels.ragged_paged_attention.reference import Fp8KVCache, check_inputs

KERNEL = CppKernel(
    Path(__file__).with_name("cpu_kernel.cc"),
    "JaxinferRaggedPagedAttention",
    "jaxinfer_ragged_paged_attention_cpu",
)
DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
unavailable_reason, available = KERNEL.unavailable_reason, KERNEL.available


@functools.cache
def library() -> ctypes.CDLL:
    """The kernel's library (built and registered on first use; RuntimeError if it cannot be),
    pointed at the linear kernel's lingering helpers where that kernel builds here: a decode's
    attention then runs on both cores between two products (`cpu_helpers.h`)."""
    lib = KERNEL.library()
    if linear_cpu.available():
        box = linear_cpu.library().JaxinferCpuHelperBox
        box.restype = ctypes.c_void_p
        share = lib.JaxinferCpuUseHelperBox
        share.argtypes = [ctypes.c_void_p]
        share(box())
    return lib


@functools.partial(
    jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap", "interpret", "blocks")
)
def ragged_paged_attention(
    q: jax.Array,  # [T, Hq, D]
    kv_cache: jax.Array | Fp8KVCache,  # [P, page_size, 2*Hkv, D]
    kv_lens: jax.Array,  # i32[S]
    page_indices: jax.Array,  # i32[S, pages_per_seq]
    cu_q_lens: jax.Array,  # i32[S+1]
    num_seqs: jax.Array,  # i32[1]
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: jax.Array | None = None,  # f32[Hq]
    interpret: pc.Interpret = False,  # accepted for signature parity; always runs compiled
    blocks: None = None,
    causal_bound: jax.Array | None = None,  # i32[T] (the reference's)
) -> jax.Array:  # [T, Hq, D]
    del interpret
    if blocks is not None:
        raise ValueError("the CPU kernel has fixed tiles: blocks must be None")
    check_inputs(q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs)
    fp8 = isinstance(kv_cache, Fp8KVCache)
    for name, x in (("q", q), ("kv_cache", kv_cache)):
        if x.dtype not in DTYPES and not (fp8 and name == "kv_cache"):
            raise ValueError(f"the CPU kernel takes float32 or bfloat16 {name}, got {x.dtype}")
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window must be positive, got {sliding_window}")
    if soft_cap is not None and soft_cap <= 0:
        raise ValueError(f"soft_cap must be positive, got {soft_cap}")
    hq = q.shape[1]
    if sinks is not None and sinks.shape != (hq,):
        raise ValueError(f"sinks must be f32[{hq}] (one per query head), got {sinks.shape}")
    if causal_bound is not None and causal_bound.shape != (q.shape[0],):
        raise ValueError(f"causal_bound must be i32[{q.shape[0]}], got {causal_bound.shape}")
    library()
    bound = jnp.zeros((1,), jnp.int32) if causal_bound is None else causal_bound.astype(jnp.int32)
    sink_arr = jnp.zeros((hq,), jnp.float32) if sinks is None else sinks.astype(jnp.float32)
    call = jax.ffi.ffi_call(KERNEL.target, jax.ShapeDtypeStruct(q.shape, q.dtype))
    # An fp8 cache passes its values and its exponents; a float one a placeholder exponent.
    data, exponents = (
        (kv_cache.data, kv_cache.exponent) if fp8 else (kv_cache, jnp.zeros((1,), jnp.int8))
    )
    return call(
        q,
        data,
        exponents,
        kv_lens,
        page_indices,
        cu_q_lens,
        num_seqs,
        sink_arr,
        bound,
        sm_scale=np.float32(sm_scale),
        sliding_window=np.int64(sliding_window or 0),
        soft_cap=np.float32(soft_cap or 0.0),
        has_sinks=sinks is not None,
        has_bound=causal_bound is not None,
    )
