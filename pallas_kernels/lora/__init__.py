"""Multi-LoRA kernels: `gpu.lora_apply` (Pallas, Triton lowering) adds each token's adapter
product for one input group in one launch; the XLA formulation it must equal is
`jaxinfer.lora.device.apply` (the CPU and TPU path)."""

from pallas_kernels.lora import gpu

__all__ = ["gpu"]
