"""The runner's LoRA room: device stacks plus a host LRU of parsed adapters.

1. `LoRAManager(cfg, max_loras, max_lora_rank, max_cpu_loras)` allocates the empty stacks
   (`device.empty_stacks`): the runner attaches them to its params before any program compiles.
2. `load(loads)` applies a step's `SchedulerOutput.lora_loads` (slot, LoRARequest) in order: the
   adapter comes from the host cache (keyed by `lora_int_id`, at most `max_cpu_loras`, least
   recently used dropped) or from its PEFT directory, and is written into its slot. Returns the
   new stacks (same shapes: nothing recompiles).
3. `remove(ids)` drops unloaded adapters from the host cache (their slots were freed by the
   scheduler's `LoRASlots.forget`; a freed slot is never read before a load rewrites it).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxinfer.config import ModelConfig
from jaxinfer.lora import device
from jaxinfer.lora.adapter import LoRAAdapter, load_adapter
from jaxinfer.lora.request import LoRARequest


class LoRAManager:
    def __init__(
        self,
        cfg: ModelConfig,
        max_loras: int,
        max_lora_rank: int,
        max_cpu_loras: int | None = None,
        dtype: Any = jnp.float32,
        shardings: Callable[[tuple], Any] | None = None,
    ) -> None:
        """`shardings(stacks)` gives the stacks' sharding tree on a mesh (None: one device)."""
        self.cfg, self.max_lora_rank = cfg, max_lora_rank
        self.max_cpu_loras = max(max_cpu_loras or max_loras, max_loras)
        stacks = device.empty_stacks(cfg, max_loras, max_lora_rank, dtype)
        self._shardings = None if shardings is None else shardings(stacks)
        self.stacks = self._placed(stacks)
        self._host: collections.OrderedDict[int, LoRAAdapter] = collections.OrderedDict()

    def adapter(self, lora: LoRARequest) -> LoRAAdapter:
        """The parsed adapter (host LRU of `max_cpu_loras`)."""
        got = self._host.pop(lora.lora_int_id, None)
        if got is None:
            got = load_adapter(lora.lora_path, self.cfg, self.max_lora_rank)
        self._host[lora.lora_int_id] = got
        while len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)
        return got

    def load(self, loads: list[tuple[int, LoRARequest]]) -> tuple:
        for slot, lora in loads:
            self.stacks = self._placed(device.write_slot(self.stacks, slot, self.adapter(lora)))
        return self.stacks

    def remove(self, lora_int_ids: list[int]) -> None:
        for lora_int_id in lora_int_ids:
            self._host.pop(lora_int_id, None)

    def _placed(self, stacks: tuple) -> tuple:
        """NOTE: a no-op where the write kept the stacks' shardings."""
        return stacks if self._shardings is None else jax.device_put(stacks, self._shardings)
