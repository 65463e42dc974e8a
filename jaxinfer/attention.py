"""The one attention op: write the step's new K/V into the paged cache, then attend.

1. `update_kv_cache` scatters this step's K/V into their slots (`slot_mapping`).
2. The chosen backend's `ragged_paged_attention` attends every query token to its own sequence's
   pages. The pure-JAX reference is the oracle (and the CPU path).
"""

from __future__ import annotations

import jax

from jaxinfer.step import StepInputs
from pallas_kernels.ragged_paged_attention import reference

BACKENDS = ("reference",)


def kv_cache_shape(backend: str, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    check_backend(backend)
    return reference.kv_cache_shape(num_pages, page_size, num_kv_heads, head_dim)


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"attention_backend {backend!r} is not one of {BACKENDS}")


def attention(
    q: jax.Array,  # [T, Hq, D]
    k: jax.Array,  # [T, Hkv, D]
    v: jax.Array,  # [T, Hkv, D]
    kv_cache: jax.Array,  # [P, page_size, 2*Hkv, D]
    step: StepInputs,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    backend: str = "reference",
) -> tuple[jax.Array, jax.Array]:
    """Returns (out [T, Hq, D], updated kv_cache)."""
    check_backend(backend)
    with jax.named_scope("kv_write"):
        kv_cache = reference.update_kv_cache(kv_cache, k, v, step.slot_mapping)
    with jax.named_scope("paged_attention"):
        out = reference.ragged_paged_attention(
            q, kv_cache, step.kv_lens, step.page_indices, step.cu_q_lens, step.num_seqs,
            sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    return out, kv_cache
