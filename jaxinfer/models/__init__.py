"""Model families and the dispatch from a `ModelConfig` to its family (`registry`).

Every family's runtime module exposes the same surface: `param_specs` (with `quantization=`:
`QArray` leaves), `params_from_hf` (quantizing on the host as it reads), `forward`, `kv_cache_shape`
(from its attention backend: model code never hard-codes a layout), `kv_cache_bytes_per_token` (what
the engine sizes pages by, for the model dtype or `kv_cache_dtype`), `check_kv_cache_dtype` (raises
naming the field when the family or backend cannot store it), `kv_cache_spec` (its sharding) and
`kv_cache_specs` (the sharding of one layer's cache pytree, an fp8 cache's exponents included).

Layout: `registry` (model_type -> family), `llama_config` / `deepseek_config` (each family's HF
config parsing and registration, JAX-free), `llama` / `deepseek` (params and forward),
`llama_weights` (llama's HF tensor names), `hf_weights` (filling a params tree from HF tensors),
`sharded` (the one `shard_map` wrapper every family's `forward` runs through).
"""

from __future__ import annotations

import importlib
from types import ModuleType

from jaxinfer.config import ModelConfig
from jaxinfer.models import deepseek_config, llama_config, registry  # noqa: F401  (registers)


def family_of(cfg: ModelConfig) -> ModuleType:
    """The runtime module of the family registered for `cfg.model_type` (e.g. `models.llama`)."""
    return importlib.import_module(registry.family(cfg.model_type).module)
