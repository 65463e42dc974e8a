"""Dense products of few token rows: one signature, several backends (`reference` is the oracle).

- `reference`: pure JAX, the oracle; also `check_inputs` (trace-time shapes and dtypes every
  backend shares) and `linear_offsets`, the exact emulation of the CPU kernel's int4 integer
  products (`cpu.linear(..., offsets=)`: x quantized to 15 bits per `QBLOCK` channels).
- `cpu`: C++ kernel for XLA:CPU through the XLA FFI (`cpu_kernel.cc`), compiled on first use
  (`cpu.available()`); `jaxinfer.layers.dense` picks it for steps of at most `cpu.MAX_ROWS` rows.
- `gpu`: Pallas (Triton) dequantizing matmul of int8 / int4 weights for at most `gpu.MAX_ROWS`
  rows, `gpu.quantized_matmul(x, data, scale, offset)` (one weight per call; its own signature);
  `jaxinfer.layers.dense` picks it with linear backend "gpu" (`auto` on a GPU target).

Every backend in `KERNELS` has the reference's `linear(x, *weights, transposed=, scales=)`.
"""

from pallas_kernels.linear import cpu, gpu, reference
from pallas_kernels.linear.reference import check_inputs, linear

KERNELS = {
    "reference": reference.linear,
    "cpu": cpu.linear,
}

__all__ = ["KERNELS", "check_inputs", "cpu", "gpu", "linear", "reference"]
