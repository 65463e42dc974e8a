"""Ragged paged multi-head latent attention (DeepSeek MLA): one signature, several backends.

- `reference`: pure JAX, the oracle and the CPU path; also `update_kv_cache` (the latent write
  every backend uses), `kv_cache_shape` (the latent layout) and `check_inputs`.
- `gpu`: Pallas kernel for the Triton lowering.

Every backend's `mla_ragged_paged_attention` has the reference's signature, including `interpret=`.
"""

from pallas_kernels.mla_paged_attention import gpu, reference
from pallas_kernels.mla_paged_attention.reference import (
    check_inputs,
    kv_cache_shape,
    mla_ragged_paged_attention,
    update_kv_cache,
)

KERNELS = {
    "reference": reference.mla_ragged_paged_attention,
    "gpu": gpu.mla_ragged_paged_attention,
}

__all__ = [
    "KERNELS",
    "check_inputs",
    "gpu",
    "kv_cache_shape",
    "mla_ragged_paged_attention",
    "reference",
    "update_kv_cache",
]
