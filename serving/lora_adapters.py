"""The served LoRA adapters: OpenAI `model` names -> `LoRARequest`s (front end, no JAX).

1. `--lora-modules name=path ...` registers adapters at start (`add`); each gets the next
   `lora_int_id` (its identity in the core's slots and prefix cache).
2. `resolve(model)` is the adapter a request's `model` names (None: the base model).
3. `POST /v1/load_lora_adapter` / `/v1/unload_lora_adapter` (when `VLLM_ALLOW_RUNTIME_LORA_UPDATING`
   is true, as vLLM) call `add` / `remove`: a reload of a name gets a new id, so no request
   ever reads a stale cached page or slot of an older adapter under that name.

NOTE: `add` checks `adapter_config.json` (rank against `max_lora_rank`, refused fields); the
core reads the weights when a request first needs them.
"""

from __future__ import annotations

import itertools
import os

from jaxinfer.lora.adapter import LoRAError, read_config
from jaxinfer.lora.request import LoRARequest

RUNTIME_UPDATES_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_updates_allowed() -> bool:
    return os.environ.get(RUNTIME_UPDATES_ENV, "").strip().lower() in ("1", "true")


class LoRAAdapters:
    def __init__(self, max_lora_rank: int = 16) -> None:
        self.max_lora_rank = max_lora_rank
        self.by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    def add(self, name: str, path: str) -> LoRARequest:
        """Registers an adapter; LoRAError (naming the field) when it is refused."""
        if not name:
            raise LoRAError("lora_name must be a non-empty string", "lora_name")
        if name in self.by_name:
            raise LoRAError(f"the LoRA adapter {name!r} is already loaded", "lora_name")
        read_config(path, self.max_lora_rank)
        lora = self.by_name[name] = LoRARequest(name, next(self._ids), path)
        return lora

    def remove(self, name: str) -> LoRARequest:
        if name not in self.by_name:
            raise LoRAError(f"no LoRA adapter named {name!r} is loaded", "lora_name")
        return self.by_name.pop(name)

    def resolve(self, model: str | None) -> LoRARequest | None:
        return self.by_name.get(model) if model else None


def parse_lora_modules(specs: list[str]) -> list[tuple[str, str]]:
    """`--lora-modules name=path ...` -> [(name, path)]; ValueError naming a bad entry."""
    out = []
    for spec in specs or []:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules entry {spec!r} is not name=path")
        out.append((name, path))
    return out
