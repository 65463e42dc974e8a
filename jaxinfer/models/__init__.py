"""Model families (one file each) and the dispatch from a `ModelConfig` to its family.

Every family module exposes the same surface: `param_specs` (with `quantization=`: `QArray`
leaves), `params_from_hf` (quantizing on the host as it reads), `forward`, `kv_cache_shape` (from
its attention backend: model code never hard-codes a layout), `kv_cache_bytes_per_token` (what the
engine sizes pages by, for the model dtype or `kv_cache_dtype`), `check_kv_cache_dtype` (raises
naming the field when the family or backend cannot store it), `kv_cache_spec` (its sharding) and
`kv_cache_specs` (the sharding of one layer's cache pytree, an fp8 cache's exponents included).
"""

from __future__ import annotations

from types import ModuleType

from jaxinfer.config import DEEPSEEK_MODEL_TYPES, ModelConfig


def family_of(cfg: ModelConfig) -> ModuleType:
    """The module that runs `cfg`: `deepseek` for DeepSeek-V2/V3, `llama` for every other family."""
    if cfg.model_type in DEEPSEEK_MODEL_TYPES:
        from jaxinfer.models import deepseek

        return deepseek
    from jaxinfer.models import llama

    return llama
