"""`LoRARequest`: which adapter a request runs with (vLLM's `vllm.lora.request.LoRARequest`)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """An adapter: `lora_name` (unique, what the OpenAI `model` field names), `lora_int_id` (> 0,
    unique: the adapter's identity in caches and slots), `lora_path` (a PEFT checkpoint directory)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id <= 0:
            raise ValueError(f"lora_int_id must be a positive int, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must be a non-empty string")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
