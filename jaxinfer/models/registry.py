"""The model registry: a Hugging Face `model_type` (or `architectures` name) -> the family that
parses its config and runs it.

1. Each family's config module (`llama_config`, `deepseek_config`: JAX-free) calls
   `register(Family(...))` when imported; `jaxinfer.models` imports them, so importing this module
   registers the built-in families.
2. `ModelConfig.from_hf` calls `parse_hf(hf)`: the family is found by `hf["model_type"]` (or, when
   that is absent, by a registered `architectures` name) and its `parse` returns the `ModelConfig`.
   An unknown one raises `UnsupportedConfigError` naming it and listing every registered family.
3. `jaxinfer.models.family_of(cfg)` imports the runtime module of `cfg.model_type`'s family (the
   only step that imports JAX): `param_specs`, `params_from_hf`, `forward`, `kv_cache_*`.

NOTE: registration order is the order `supported_model_types()` lists them in.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from jaxinfer.config import ModelConfig, UnsupportedConfigError


@dataclasses.dataclass(frozen=True)
class Family:
    """One HF `model_type` and how we serve it."""

    model_type: str
    module: str  # the runtime module's import path, e.g. "jaxinfer.models.llama"
    parse: Callable[[dict[str, Any]], ModelConfig]  # HF config dict -> ModelConfig (raises)
    architectures: tuple[str, ...] = ()  # HF `architectures` names that mean this model_type
    declaration: Any = None  # what the family's own modules read (e.g. a `llama_config.LlamaLike`)


_FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Adds `family`; raises when its model_type is already registered."""
    old = _FAMILIES.get(family.model_type)
    if old is not None:
        raise ValueError(f"model_type {family.model_type!r} is already registered ({old.module})")
    _FAMILIES[family.model_type] = family
    return family


def unregister(model_type: str) -> None:
    """Removes a registered model_type (tests that declare a family of their own)."""
    del _FAMILIES[model_type]


def supported_model_types() -> tuple[str, ...]:
    return tuple(_FAMILIES)


def supported_architectures() -> tuple[str, ...]:
    return tuple(a for f in _FAMILIES.values() for a in f.architectures)


def family(model_type: str | None, architectures: Any = None) -> Family:
    """The family registered for `model_type` (or, when it is None, for one of `architectures`)."""
    if model_type in _FAMILIES:
        return _FAMILIES[model_type]
    if model_type is None:
        for arch in architectures or ():
            for f in _FAMILIES.values():
                if arch in f.architectures:
                    return f
    raise UnsupportedConfigError(
        f"unsupported architecture model_type={model_type!r} (architectures={architectures}); "
        f"supported: {', '.join(supported_model_types())} "
        f"(architectures: {', '.join(supported_architectures())})"
    )


def parse_hf(hf: dict[str, Any]) -> ModelConfig:
    """`ModelConfig.from_hf`: the registered family's parse of the HF config dict `hf` (found by an
    `architectures` name, `hf` is parsed as if it named that family's model_type)."""
    found = family(hf.get("model_type"), hf.get("architectures"))
    return found.parse({**hf, "model_type": found.model_type})
