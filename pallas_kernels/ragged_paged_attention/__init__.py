"""Ragged paged attention: one signature, several backends (`reference` is the oracle)."""

from pallas_kernels.ragged_paged_attention.reference import (
    kv_cache_shape,
    ragged_paged_attention,
    update_kv_cache,
)

__all__ = ["kv_cache_shape", "ragged_paged_attention", "update_kv_cache"]
