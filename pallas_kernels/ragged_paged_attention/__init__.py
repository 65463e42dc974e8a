"""Ragged paged attention: one signature, several backends (`reference` is the oracle).

- `reference`: pure JAX, the oracle and the CPU path; also `update_kv_cache` (the KV write every
  backend uses), `check_inputs` (trace-time shapes) and `check_values` (host-side metadata values).
- `cpu`: C++ kernel for XLA:CPU through the XLA FFI, compiled on first use (`cpu.available()`).
- `gpu`: Pallas kernel for the Triton lowering.
- `tpu`: Pallas kernel for Mosaic (scalar prefetch, double-buffered page DMAs).
- `block_sizes`: tuned block sizes as data, and the work table both kernels put on their grid.

Every backend's `ragged_paged_attention` has the reference's signature, including `interpret=`
(the compiled CPU kernel accepts and ignores it).
"""

from pallas_kernels.ragged_paged_attention import block_sizes, cpu, gpu, reference, tpu
from pallas_kernels.ragged_paged_attention.reference import (
    check_inputs,
    check_values,
    kv_cache_shape,
    ragged_paged_attention,
    update_kv_cache,
)

KERNELS = {
    "reference": reference.ragged_paged_attention,
    "cpu": cpu.ragged_paged_attention,
    "gpu": gpu.ragged_paged_attention,
    "tpu": tpu.ragged_paged_attention,
}

__all__ = [
    "KERNELS",
    "block_sizes",
    "check_inputs",
    "check_values",
    "cpu",
    "gpu",
    "kv_cache_shape",
    "ragged_paged_attention",
    "reference",
    "tpu",
    "update_kv_cache",
]
