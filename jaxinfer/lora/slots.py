"""The scheduler's view of the LoRA device slots (host, no JAX).

1. `acquire(lora)` pins a slot for a request about to run: the adapter's slot if it is loaded,
   else a free slot, else the least recently used unpinned one (evicting its adapter); the
   (slot, adapter) pair to load is queued for the runner (`take_loads`, sent in the step's
   `SchedulerOutput.lora_loads`). None when every slot is pinned: the request waits.
2. `release(slot)` unpins (preemption, finish): the slot keeps its adapter, most recently used.
3. `forget(lora_int_id)` unloads an adapter (`/v1/unload_lora_adapter`, vLLM's `remove_lora`):
   its slot is freed at once when no running request pins it, else when the last one releases
   it (requests already running or queued under it finish under it, as in vLLM); its id is
   queued for the runner to drop its host copy (`take_removes`, sent in
   `SchedulerOutput.lora_removes`). A reload under the same name is a new `lora_int_id`.

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
        self._removed: set[int] = set()  # unloaded ids: their slot is freed, not kept, on release
        self._removes: list[int] = []

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
            if self.adapters[slot].lora_int_id in self._removed:
                self._free_slot(slot)
            else:
                self._unpinned[slot] = None

    def forget(self, lora_int_id: int) -> bool:
        """Unloads an adapter: True when its slot (if it had one) is free now, False when running
        requests pin it (freed as the last one releases it)."""
        self._removed.add(lora_int_id)
        self._removes.append(lora_int_id)
        slot = self._slot_of.get(lora_int_id)
        if slot is None or self.pins[slot]:
            return slot is None
        self._free_slot(slot)
        return True

    def _free_slot(self, slot: int) -> None:
        del self._slot_of[self.adapters[slot].lora_int_id]
        self._unpinned.pop(slot, None)
        self.adapters[slot] = None
        self._free.append(slot)

    def take_removes(self) -> list[int]:
        removes, self._removes = self._removes, []
        return removes

    def loaded(self) -> dict[int, int]:
        """lora_int_id -> slot of every adapter holding a slot."""
        return dict(self._slot_of)

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
