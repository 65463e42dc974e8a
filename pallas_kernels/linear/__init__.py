"""Dense products of few token rows: one signature, several backends (`reference` is the oracle).

- `reference`: pure JAX, the oracle; also `check_inputs` (trace-time shapes and dtypes every
  backend shares).
- `cpu`: C++ kernel for XLA:CPU through the XLA FFI (`cpu_kernel.cc`), compiled on first use
  (`cpu.available()`); `jaxinfer.layers.dense` picks it for steps of at most `cpu.MAX_ROWS` rows.

Every backend's `linear(x, *weights, transposed=, scales=)` has the reference's signature.
"""

from pallas_kernels.linear import cpu, reference
from pallas_kernels.linear.reference import check_inputs, linear

KERNELS = {
    "reference": reference.linear,
    "cpu": cpu.linear,
}

__all__ = ["KERNELS", "check_inputs", "cpu", "linear", "reference"]
