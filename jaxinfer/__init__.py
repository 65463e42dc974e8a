"""jaxinfer: LLM inference in JAX/XLA over a paged KV cache.

Public API: `LLM`, `SamplingParams`, `StructuredOutputsParams`, `RequestOutput`. Imports are lazy so host-only modules
(the scheduler, the page allocator) can be used without importing JAX.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LLM", "LoRARequest", "RequestOutput", "SamplingParams", "StructuredOutputsParams"]


def __getattr__(name: str) -> Any:
    if name in ("SamplingParams", "StructuredOutputsParams"):
        from jaxinfer import sampling_params

        return getattr(sampling_params, name)
    if name == "LoRARequest":
        from jaxinfer.lora.request import LoRARequest

        return LoRARequest
    if name in ("LLM", "RequestOutput"):
        from jaxinfer import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'jaxinfer' has no attribute {name!r}")
