"""The one attention op: write the step's new K/V into the paged cache, then attend.

1. `resolve_backend` turns `attention_backend` ("auto" | "reference" | "cpu" | "gpu" | "tpu") into
   a kernel: "auto" picks by platform (gpu -> "gpu", tpu -> "tpu", cpu -> the compiled "cpu"
   kernel when it builds on this machine, else "reference", with a warning saying why); the
   platform is the target's (`pallas_kernels.target`: JAX's default backend, or the device
   `jaxinfer.aot` compiles for), never assumed from the machine it runs on. On a CPU
   platform the "gpu" and "tpu" kernels run in Pallas interpret mode; "cpu" runs only there.
   `None` (every engine's default) is "auto" on every platform: the GPU kernel ran on an H100 on
   2026-11-24 (correct, and 2.5-50x faster than the reference) and the Mosaic kernel compiles
   for TPU v5e and v6e in every shipped configuration (tests/test_accel_kernels.py); the
   reference stays selectable by name.
2. `update_kv_cache` scatters this step's K/V into their slots (`slot_mapping`) in the cache
   layout of the backend (`kv_cache_shape`): the reference layout `[P, page_size, 2*Hkv, D]`
   for every backend but "tpu", whose `tpu_layout` `[P, Hkv, page_size, W]` XLA stores
   row-major on a TPU, so the kernel reads it in place; on a TPU the write is itself a Pallas
   kernel that updates the touched tiles in place (`tpu_write`: XLA's scatter moved a small
   layer cache whole into VMEM and back). `kv_cache_dtype="fp8"` makes the cache a
   `reference.Fp8KVCache` (float8_e4m3fn values, one power-of-two scale per slot and K/V head);
   `FP8_KV_BACKENDS` (every backend today) read it; a backend missing there is refused naming the
   field (`check_kv_cache_dtype`).
3. The chosen backend's `ragged_paged_attention` attends every query token to its own sequence's
   pages, causally up to `StepInputs.causal_bound` where the step has one (image tokens see
   their whole image). The pure-JAX reference is the oracle every kernel is tested against.
4. `attention_qkv` (the "gpu" backend on a decode step, `takes_qkv`): steps 2-3 and the RoPE of
   q and k in one kernel reading the fused QKV product (`gpu_decode_qkv`), where the model hands
   over its QKV product and the step's cos/sin (`expand_rope`) instead of rotated q, k, v.
"""

from __future__ import annotations

import functools
import logging

import jax

from jaxinfer.step import StepInputs
from pallas_kernels import target
from pallas_kernels.paged_common import interpret_mode
from pallas_kernels.ragged_paged_attention import (
    KERNELS,
    cpu,
    gpu_decode_qkv,
    reference,
    tpu_layout,
    tpu_write,
)

BACKENDS = ("auto", "reference", "cpu", "gpu", "tpu")
KV_CACHE_DTYPES = ("auto", "fp8")
# The backends that read an fp8 cache (`reference.Fp8KVCache`): all of today's; a backend added
# later is refused with kv_cache_dtype='fp8' until it is listed here.
FP8_KV_BACKENDS = ("reference", "cpu", "gpu", "tpu")
_AUTO = {"gpu": "gpu", "cuda": "gpu", "tpu": "tpu"}
log = logging.getLogger(__name__)


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"attention_backend {backend!r} is not one of {BACKENDS}")


def resolve_backend(backend: str | None, platform: str | None = None) -> str:
    """The concrete backend for `backend` (None: the default) on `platform` (default: the target
    platform, `pallas_kernels.target.platform()`: JAX's default backend outside `jaxinfer.aot`)."""
    platform = platform or target.platform()
    if backend is None:
        backend = "auto"
    check_backend(backend)
    if backend == "cpu" and platform != "cpu":
        raise ValueError(f"attention_backend 'cpu' runs on the CPU platform only, not {platform!r}")
    if backend == "cpu":
        cpu.library()  # NOTE: registered before a cached executable that calls it is loaded
    if backend != "auto":
        return backend
    if platform == "cpu":
        return _cpu_or_reference()
    return _AUTO.get(platform, "reference")


@functools.cache
def _cpu_or_reference() -> str:
    reason = cpu.unavailable_reason()
    if reason is None:
        return "cpu"
    log.warning(
        "attention_backend 'auto': the CPU kernel is unavailable, using 'reference' (%s)", reason
    )
    return "reference"


def check_kv_cache_dtype(backend: str, kv_cache_dtype: str) -> None:
    """Raises naming `kv_cache_dtype` when it is unknown or the (resolved) backend cannot read it."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r} is not supported; choose one of {KV_CACHE_DTYPES}"
        )
    if kv_cache_dtype == "fp8" and backend not in FP8_KV_BACKENDS:
        raise ValueError(
            f"kv_cache_dtype='fp8' is not readable by attention_backend {backend!r}; "
            f"use one of {FP8_KV_BACKENDS} or kv_cache_dtype='auto'"
        )


def _tpu_layout(backend: str | None, platform: str | None = None) -> bool:
    return resolve_backend(backend, platform) == "tpu"


def new_kv_cache(
    shape: tuple[int, ...],
    dtype,
    kv_cache_dtype: str = "auto",
    backend: str | None = "reference",
    platform: str | None = None,
):
    """An empty cache of `shape` (`kv_cache_shape` of `backend`): the model dtype, or an
    `Fp8KVCache`."""
    if _tpu_layout(backend, platform):
        check_kv_cache_dtype("tpu", kv_cache_dtype)
        return tpu_layout.new_kv_cache(shape, dtype, kv_cache_dtype)
    return reference.new_kv_cache(shape, dtype, kv_cache_dtype)


def kv_cache_bytes_per_row(
    head_dim: int,
    dtype_bytes: int,
    kv_cache_dtype: str,
    backend: str | None = "reference",
    page_size: int = 16,
    platform: str | None = None,
) -> float:
    """Bytes of one (slot, K-or-V head) row: head_dim values (+ the fp8 row's exponent byte); in
    the TPU layout with its lane padding and fp8 exponent tiles (`tpu_layout`)."""
    if _tpu_layout(backend, platform):
        fp8 = kv_cache_dtype == "fp8"
        return tpu_layout.cache_bytes_per_row(head_dim, page_size, dtype_bytes, fp8)
    return head_dim + 1 if kv_cache_dtype == "fp8" else head_dim * dtype_bytes


def kv_cache_shape(
    backend: str | None,
    num_pages: int,
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    platform: str | None = None,
) -> tuple[int, ...]:
    """The reference layout [P, page_size, 2*Hkv, D] (K even, V odd), or for "tpu" its own
    [P, Hkv, page_size, W] (`tpu_layout`)."""
    if _tpu_layout(backend, platform):
        return tpu_layout.kv_cache_shape(num_pages, page_size, num_kv_heads, head_dim)
    return reference.kv_cache_shape(num_pages, page_size, num_kv_heads, head_dim)


def kv_cache_heads_axis(backend: str | None, platform: str | None = None) -> int:
    """The KV-heads axis of `kv_cache_shape` (the one tensor parallelism splits)."""
    return 1 if _tpu_layout(backend, platform) else 2


def _write(backend: str):
    """The KV write of `backend`: on a TPU the in-place Pallas kernel (`tpu_write`); the "tpu"
    backend in interpret mode (a CPU platform) keeps XLA's write of the same layout (the same
    bits, tests/test_accel_kernels.py; interpreting the kernel every step would only be slower)."""
    if backend != "tpu":
        return reference.update_kv_cache
    if interpret_mode("tpu") is False:
        return tpu_write.update_kv_cache
    return tpu_layout.update_kv_cache


def attention(
    q: jax.Array,  # [T, Hq, D]
    k: jax.Array,  # [T, Hkv, D]
    v: jax.Array,  # [T, Hkv, D]
    kv_cache: jax.Array | reference.Fp8KVCache,  # `kv_cache_shape(backend, ...)`
    step: StepInputs,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: jax.Array | None = None,  # f32[Hq]
    backend: str = "reference",
) -> tuple[jax.Array, jax.Array]:
    """Returns (out [T, Hq, D], updated kv_cache)."""
    backend = resolve_backend(backend)
    if isinstance(kv_cache, reference.Fp8KVCache):
        check_kv_cache_dtype(backend, "fp8")
    with jax.named_scope("kv_write"):
        kv_cache = _write(backend)(kv_cache, k, v, step.slot_mapping)
    # NOTE: a one-token step decodes (its only live sequence holds its only token), and the runner
    # marks pure-decode steps (`StepInputs.decode_only`): the GPU kernel's decode-only path
    # launches once, without query classes or work tables
    decode = q.shape[0] == 1 or step.decode_only
    extra = {"decode_only": True} if backend == "gpu" and decode else {}
    if step.causal_bound is not None:  # image tokens in this step: never the decode-only path
        extra = {"causal_bound": step.causal_bound}
    with jax.named_scope("paged_attention"):
        out = KERNELS[backend](
            q,
            kv_cache,
            step.kv_lens,
            step.page_indices,
            step.cu_q_lens,
            step.num_seqs,
            sm_scale=sm_scale,
            sliding_window=sliding_window,
            soft_cap=soft_cap,
            sinks=sinks,
            interpret=interpret_mode(backend),
            **extra,
        )
    return out, kv_cache


def expand_rope(cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The step's cos/sin f32[T, D/2] as `attention_qkv` takes them (f32[T, D]; once per step)."""
    return gpu_decode_qkv.expand_rope(cos, sin)


def takes_qkv(
    backend: str | None,
    qkv: jax.Array,
    kv_cache: jax.Array | reference.Fp8KVCache,
    step: StepInputs,
) -> bool:
    """Whether `attention_qkv` serves this step (step 4 of the module docstring): the "gpu"
    backend on a one-token or pure-decode step (`StepInputs.decode_only`), over a cache of qkv's
    16-bit dtype (not fp8: the kernel writes plain rows; 16 bits: its rotation is an exact dot)."""
    return (
        resolve_backend(backend) == "gpu"
        and not isinstance(kv_cache, reference.Fp8KVCache)
        and (qkv.shape[0] == 1 or step.decode_only)
        and qkv.dtype == kv_cache.dtype
        and qkv.dtype.itemsize == 2
    )


def attention_qkv(
    qkv: jax.Array,  # [T, Hkv, G+2, D]: the QKV product (bias, LoRA added), before RoPE
    rope: tuple[jax.Array, jax.Array],  # `expand_rope(cos, sin)`
    kv_cache: jax.Array,
    step: StepInputs,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: jax.Array | None = None,
    backend: str = "gpu",
) -> tuple[jax.Array, jax.Array]:
    """`attention` of (rope(q), rope(k), v) split from qkv, as one kernel where `takes_qkv`;
    returns (out [T, Hq, D], updated kv_cache)."""
    if not takes_qkv(backend, qkv, kv_cache, step):
        raise ValueError("attention_qkv serves the 'gpu' backend's decode steps (takes_qkv)")
    with jax.named_scope("paged_attention"):
        return gpu_decode_qkv.qkv_decode_attention(
            qkv,
            *rope,
            kv_cache,
            step.slot_mapping,
            step.kv_lens,
            step.page_indices,
            step.num_seqs,
            sinks,
            sm_scale=sm_scale,
            sliding_window=sliding_window,
            soft_cap=soft_cap,
            interpret=interpret_mode("gpu"),
        )
