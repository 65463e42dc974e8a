"""The TPU formulation of quantized products of few rows (`layers.dense`, `dense_transposed`).

On a TPU target fewer than `layers.TPU_MIN_ROWS` rows times an int8 / int4 weight run padded to
that many, as per-group products that keep a fused weight's output dims (qkv [E, Hkv, G+2, D],
gate_up [E, 2, F]; `tests/test_aot_quant.py` checks the v5e compile reads the codes in place).
Here, on the CPU with the target platform reported as "tpu", the results equal the f32 product
with the dequantized weight (to 1e-5 of the output's scale) at 1 and 3 rows, and keep x's rows.
"""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from checkpoints import quantize as qlib  # noqa: E402
from jaxinfer import layers  # noqa: E402
from jaxinfer.quantization import QArray  # noqa: E402

E, GROUPS = 256, 2
SHAPES = {"qkv": (2, 4, 16), "gate_up": (2, 48), "o": (64,)}


def _weight(fmt: str, shape: tuple[int, ...], axis: int, seed: int) -> tuple[QArray, np.ndarray]:
    w = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    if fmt == "int4":
        data, scale, offset = qlib.quantize4(w, axis, GROUPS)
        q = QArray(jnp.asarray(data), jnp.asarray(scale), jnp.asarray(offset))
    else:
        data, scale = qlib.quantize(w, "int8", axis, GROUPS)
        q, offset = QArray(jnp.asarray(data), jnp.asarray(scale)), None
    f32 = lambda a: None if a is None else np.asarray(a, np.float32)  # noqa: E731
    return q, qlib.dequantize(np.asarray(data), f32(scale), axis, offset=f32(offset))


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_padded_products_equal_the_dequantized_weight(fmt, monkeypatch):
    monkeypatch.setattr(layers.target, "platform", lambda: "tpu")
    rng = np.random.default_rng(3)
    for i, out in enumerate(SHAPES.values()):
        w, ref = _weight(fmt, (E, *out), 0, i)
        for t in (1, 3):
            x = rng.standard_normal((t, E)).astype(np.float32)
            (y,) = jax.jit(lambda x, w: layers.dense(x, w))(jnp.asarray(x), w)
            want = np.tensordot(x, ref, axes=1)
            assert y.shape == want.shape
            np.testing.assert_allclose(y, want, atol=1e-5 * np.abs(want).max(), rtol=1e-5)
    # the tied embedding [V, E] as LM head, int8 under either format
    w, ref = _weight("int8", (96, E), 1, 9)
    x = rng.standard_normal((1, E)).astype(np.float32)
    y = jax.jit(lambda x, w: layers.dense_transposed(x, w))(jnp.asarray(x), w)
    want = x @ ref.T
    np.testing.assert_allclose(y, want, atol=1e-5 * np.abs(want).max(), rtol=1e-5)


def test_padding_is_for_quantized_weights_on_tpu_only(monkeypatch):
    x = jnp.zeros((1, E))
    w, _ = _weight("int8", (E, 64), 0, 0)
    assert layers._tpu_pad(x, (w,)) == 0  # the CPU
    monkeypatch.setattr(layers.target, "platform", lambda: "tpu")
    assert layers._tpu_pad(x, (w,)) == layers.TPU_MIN_ROWS - 1
    assert layers._tpu_pad(x, (jnp.zeros((E, 64)),)) == 0
    assert layers._tpu_pad(jnp.zeros((8, E)), (w,)) == 0
