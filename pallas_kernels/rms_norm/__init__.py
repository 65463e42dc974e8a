"""RMSNorm kernels: `gpu.add_rms_norm`, the residual add and the next RMSNorm in one launch."""

from pallas_kernels.rms_norm import gpu

__all__ = ["gpu"]
