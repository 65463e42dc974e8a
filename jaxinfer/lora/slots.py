"""The scheduler's view of the LoRA device slots (host, no JAX).

1. `acquire(lora)` pins a slot for a request about to run: the adapter's slot if it is loaded,
   else a free slot, else the least recently used unpinned one (evicting its adapter); the
   (slot, adapter) pair to load is queued for the runner (`take_loads`, sent in the step's
   `SchedulerOutput.lora_loads`). None when every slot is pinned: the request waits.
2. `release(slot)` unpins (preemption, finish): the slot keeps its adapter, most recently used.
3. `forget(lora_int_id)` drops an unloaded adapter's unpinned slot.

NOTE: slot numbers are 1..max_loras; 0 means "no adapter" on the device.
"""

from __future__ import annotations

import collections

from jaxinfer.lora.request import LoRARequest


class LoRASlots:
    def __init__(self, max_loras: int) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {max_loras}")
        self.max_loras = max_loras
        self.adapters: list[LoRARequest | None] = [None] * (max_loras + 1)
        self.pins = [0] * (max_loras + 1)
        self._slot_of: dict[int, int] = {}  # lora_int_id -> slot
        self._free = list(range(max_loras, 0, -1))
        self._unpinned: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU first
        self._loads: list[tuple[int, LoRARequest]] = []

    def acquire(self, lora: LoRARequest) -> int | None:
        slot = self._slot_of.get(lora.lora_int_id)
        if slot is None:
            if self._free:
                slot = self._free.pop()
            elif self._unpinned:
                slot, _ = self._unpinned.popitem(last=False)
                del self._slot_of[self.adapters[slot].lora_int_id]
            else:
                return None
            self.adapters[slot] = lora
            self._slot_of[lora.lora_int_id] = slot
            self._loads.append((slot, lora))
        self._unpinned.pop(slot, None)
        self.pins[slot] += 1
        return slot

    def release(self, slot: int) -> None:
        self.pins[slot] -= 1
        if self.pins[slot] == 0:
            self._unpinned[slot] = None

    def forget(self, lora_int_id: int) -> None:
        slot = self._slot_of.get(lora_int_id)
        if slot is not None and self.pins[slot] == 0:
            del self._slot_of[lora_int_id]
            self._unpinned.pop(slot, None)
            self.adapters[slot] = None
            self._free.append(slot)

    def take_loads(self) -> list[tuple[int, LoRARequest]]:
        loads, self._loads = self._loads, []
        return loads

    def running(self) -> list[str]:
        """Names of the adapters pinned by running requests."""
        return sorted(a.lora_name for a, n in zip(self.adapters, self.pins) if a and n)


def lora_options(config) -> tuple[int, int, int | None] | None:
    """(max_loras, max_lora_rank, max_cpu_loras) of an `EngineConfig` with enable_lora, else None."""
    if not config.enable_lora:
        return None
    return config.max_loras, config.max_lora_rank, config.max_cpu_loras
