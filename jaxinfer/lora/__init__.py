"""Multi-LoRA serving (issue 34): PEFT adapters in fixed-shape device slots, mixed in one batch.

1. `request.LoRARequest(lora_name, lora_int_id, lora_path)` names an adapter per request (vLLM's
   name and fields); JAX-free, so the front end and the scheduler may import it.
2. `peft.load_adapter(path, cfg, max_lora_rank)` reads a PEFT checkpoint (`adapter_config.json` +
   `adapter_model.safetensors`) on the host into per-layer (A, B) pairs of our weight layout
   (q separate, k/v fused as `kv`, gate/up fused as `gate_up`), scaling folded into B, refusing
   by name whatever it does not support.
3. `slots.LoRASlots` (host, no JAX) assigns adapters to the `max_loras` device slots: a device
   LRU of unpinned slots, pinned while a running request uses one; `None` when all are pinned
   (the request waits).
4. `device` (JAX): `LoRAStacks` holds every slot's weights, padded to `max_lora_rank`
   (`A [N, in, P, R]`, `B [N, P, R, out]`, P = 1 or 2 fused parts), attached to the params'
   layers; `apply` adds the batch's per-token adapter products to a dense output with one-hot
   slot masks (fixed shapes: 0, 1 or N adapters run the same program).
"""

from jaxinfer.lora.request import LoRARequest

__all__ = ["LoRARequest"]
