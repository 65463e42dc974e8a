"""The Pallas GPU dequantizing matmul (`pallas_kernels.linear.gpu`) against XLA's formulation.

Interpret mode on the CPU: int8 (grouped f32 scales) and int4 (uint4 codes, f16 scales and
offsets) weights, through `layers.dense` in the fused layouts the model hands it (qkv
[E, Hkv, G+2, D], gate_up [E, 2, F]), equal to `layers._xla_dense` (f32: 1e-5; bf16: within
bf16's eps: the
f32 product of the bf16 inputs rounded once). Deviceless: the kernel compiles through Pallas Triton for an H100 at Llama-3-8B's
projection shapes (skipped without the CUDA plugin).
"""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from checkpoints import quantize as qlib  # noqa: E402
from jaxinfer import layers  # noqa: E402
from jaxinfer.quantization import QArray  # noqa: E402
from pallas_kernels.linear import gpu as gpu_linear  # noqa: E402

E, GROUPS = 256, 2  # 2 groups of 128 input channels (the int8 / int4 group size)
SHAPES = {"qkv": (2, 4, 16), "gate_up": (2, 48)}  # [Hkv, G+2, D], [2, F] after E


def _weight(fmt: str, out: tuple[int, ...], seed: int) -> QArray:
    w = np.random.default_rng(seed).standard_normal((E, *out)).astype(np.float32)
    if fmt == "int4":
        data, scale, offset = qlib.quantize4(w, 0, GROUPS)
        return QArray(jnp.asarray(data), jnp.asarray(scale), jnp.asarray(offset))
    data, scale = qlib.quantize(w, "int8", 0, GROUPS)
    return QArray(jnp.asarray(data), jnp.asarray(scale))


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_interpreted_kernel_equals_xla_dense(fmt):
    weights = [_weight(fmt, shape, i) for i, shape in enumerate(SHAPES.values())]
    rng = np.random.default_rng(7)
    for t, dtype, part in ((1, jnp.float32, 0), (7, jnp.bfloat16, 1), (64, jnp.float32, 1)):
        w = weights[part]
        x = jnp.asarray(rng.standard_normal((t, E)), dtype)
        (y,) = layers.dense(x, w, backend="gpu")  # NOTE: interpreted: the target is the CPU
        # NOTE: XLA:CPU has no bf16 x bf16 -> f32 dot: the reference widens x (exact) and rounds
        # its f32 product to x's dtype, as the kernel does.
        want = layers._xla_dense(x.astype(jnp.float32), w).astype(dtype)
        assert y.shape == want.shape == (t, *w.shape[1:]) and y.dtype == x.dtype
        y, want = np.asarray(y, np.float32), np.asarray(want, np.float32)
        scale = float(np.abs(want).max())
        eps = 1e-5 if dtype == jnp.float32 else float(jnp.finfo(dtype).eps)
        np.testing.assert_allclose(y, want, rtol=eps, atol=eps * scale, err_msg=f"{fmt} t={t}")


def test_auto_picks_xla_on_gpu_and_the_kernel_on_request():
    assert layers.resolve_linear_backend("auto", "gpu") == "xla"  # layers.GPU_AUTO: measured
    assert layers.resolve_linear_backend("gpu", "gpu") == "gpu"
    assert layers.resolve_linear_backend("auto", "tpu") == "xla"
    assert layers.resolve_linear_backend("gpu", "cpu") == "gpu"  # interpreted there
    assert gpu_linear.supported(65, E, 64, GROUPS, jnp.int8)  # prefill rows: XLA's product
    assert gpu_linear.supported(1, E, 64, GROUPS, jnp.float8_e4m3fn)
    assert gpu_linear.supported(1, E, 64, GROUPS, jnp.uint4) is None


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_kernel_compiles_for_h100_at_8b_shapes(fmt):
    from jaxinfer import aot

    reason = aot.available("gpu")
    if reason is not None:
        pytest.skip(f"no deviceless gpu compiler: {reason}")
    codes = jnp.int8 if fmt == "int8" else jnp.uint4
    scales = jnp.dtype(qlib.SCALE_DTYPE[fmt])
    s = jax.ShapeDtypeStruct
    for k, n in ((4096, 6144), (14336, 4096)):  # Llama-3-8B's qkv and down projections
        meta = s((k // 128, n), scales)
        args = (s((16, k), jnp.bfloat16), s((k, n), codes), meta) + ((meta,) * (fmt == "int4"))
        text = aot.compile_function(gpu_linear.quantized_matmul, args, "h100").as_text()
        assert text.count('custom_call_target="__gpu$xla.gpu.triton"') == 1, text
