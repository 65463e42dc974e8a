"""Model families (one file each) and the dispatch from a `ModelConfig` to its family.

Every family module exposes the same surface: `param_specs`, `params_from_hf`, `forward`,
`kv_cache_shape` (from its attention backend: model code never hard-codes a layout),
`kv_cache_bytes_per_token` (what the engine sizes pages by) and `kv_cache_spec` (its sharding).
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
