"""The multi-head latent attention op (DeepSeek MLA): write the step's latent rows, then attend.

1. `mla_backend(backend)` maps the engine's resolved attention backend onto an MLA kernel: "gpu"
   runs `pallas_kernels.mla_paged_attention.gpu` (interpret mode off a GPU platform); "reference",
   "cpu" and "tpu" run the pure-JAX reference (there is no compiled CPU or TPU MLA kernel yet).
2. `kv_cache_shape` is the MLA backend's layout: `[P, page_size, kv_lora_rank + qk_rope_head_dim]`,
   one row per token shared by every head (no per-head K/V).
3. `mla_attention` scatters the rows into their slots (`slot_mapping`), then runs the kernel on the
   absorbed query `[q_nope @ W_uk | roped q_rope]`; the output stays in the latent space.
"""

from __future__ import annotations

import jax

from jaxinfer.attention import resolve_backend
from jaxinfer.step import StepInputs
from pallas_kernels.mla_paged_attention import KERNELS, reference
from pallas_kernels.paged_common import interpret_mode


def mla_backend(backend: str | None) -> str:
    """The MLA kernel for an attention backend name ("auto" and None resolve by platform first)."""
    return "gpu" if resolve_backend(backend) == "gpu" else "reference"


def kv_cache_shape(
    backend: str | None, num_pages: int, page_size: int, kv_lora_rank: int, qk_rope_head_dim: int
) -> tuple[int, ...]:
    mla_backend(backend)  # NOTE: every MLA backend shares the reference layout
    return reference.kv_cache_shape(num_pages, page_size, kv_lora_rank, qk_rope_head_dim)


def mla_attention(
    q: jax.Array,  # [T, H, L + R]
    rows: jax.Array,  # [T, L + R] this step's normed latents and roped keys
    kv_cache: jax.Array,  # [P, page_size, L + R]
    step: StepInputs,
    *,
    sm_scale: float,
    kv_lora_rank: int,
    backend: str = "reference",
) -> tuple[jax.Array, jax.Array]:
    """Returns (out [T, H, L] in the latent space, updated kv_cache)."""
    kernel = mla_backend(backend)
    with jax.named_scope("mla_kv_write"):
        kv_cache = reference.update_kv_cache(kv_cache, rows, step.slot_mapping)
    with jax.named_scope("mla_paged_attention"):
        out = KERNELS[kernel](
            q,
            kv_cache,
            step.kv_lens,
            step.page_indices,
            step.cu_q_lens,
            step.num_seqs,
            sm_scale=sm_scale,
            kv_lora_rank=kv_lora_rank,
            interpret=interpret_mode(kernel),
        )
    return out, kv_cache
