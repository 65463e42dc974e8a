"""jaxinfer: LLM inference in JAX/XLA over a paged KV cache.

Public API: `LLM`, `SamplingParams`, `RequestOutput`. Imports are lazy so host-only modules
(the scheduler, the page allocator) can be used without importing JAX.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LLM", "RequestOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "SamplingParams":
        from jaxinfer.sampling_params import SamplingParams

        return SamplingParams
    if name in ("LLM", "RequestOutput"):
        from jaxinfer import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'jaxinfer' has no attribute {name!r}")
