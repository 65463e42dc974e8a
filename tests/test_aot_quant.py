"""Deviceless H100 compiles of a quantized Llama-3-8B-shaped step: no weight-sized intermediate.

XLA's own int8 / int4 products materialize a float copy of the weight (or, at one row, a
weight-sized f32 partial product) before the GEMM in the deviceless compile; the linear backend
`gpu` (`auto`'s choice on a GPU: `layers.GPU_AUTO`) runs the Pallas dequantizing matmul
(`pallas_kernels.linear.gpu`), which reads the codes in their bits.
`jaxinfer.aot.intermediates.weight_sized` finds such intermediates in the optimized HLO.
One 1-token int4 step (2 layers, 8B's projection shapes, a small vocabulary to keep the compile
cheap; its embedding and LM head are int8, so both code types run the kernel: the int8 step's
verdict is the same, measured by the BENCHMARKS.md command, left out of the suite for its time);
skipped without the CUDA plugin. BENCHMARKS.md ("int4 / int8 on a GPU target")
has the before/after numbers. GPTQ act-order ("-act") weights: the H100 step launches the plain
step's kernels (the Pallas matmul reads x through the permutation) and the v5e one-row products
(x gathered by XLA first) keep the codes in place too.
"""

import json

import pytest

jax = pytest.importorskip("jax")

from jaxinfer import aot  # noqa: E402
from jaxinfer.aot import intermediates  # noqa: E402

LLAMA_8B = "scripts/configs/llama-3-8b/config.json"
BUDGET = dict(tokens=(1,), max_num_seqs=4, max_model_len=256, num_pages=32, page_size=16)


def test_h100_int4_step_reads_the_codes_in_place():
    """int4, and a GPTQ act-order checkpoint's layout ("-act"): its kernels read x through each
    weight's permutation, so its step launches exactly the plain step's kernels."""
    reason = aot.available("gpu")
    if reason is not None:
        pytest.skip(f"no deviceless gpu compiler: {reason}")
    with open(LLAMA_8B) as f:
        cfg = {**json.load(f), "num_hidden_layers": 2, "vocab_size": 1024}
    kernels = {}
    for fmt in ("int4", "int4-act"):
        (step,) = aot.compile_step(
            cfg, "h100", quantization=fmt, attention_backend="auto", linear_backend="auto", **BUDGET
        )
        assert step.report.linear_backend == "gpu"
        text = step.compiled.as_text()
        assert intermediates.weight_sized(text) == [], fmt
        # one Triton call per projection (qkv, o, gate_up, down) and the one-token step's
        # decode-only attention (its kernel, RoPE and KV write inside, and its split-K merge) per
        # layer, the add + RMSNorm kernels (layer 0's MLP norm; layer 1's two: layer 0's
        # attention norm has no residual to add) and the LM head
        assert step.report.pallas_calls == 2 * (4 + 2) + 3 + 1, (fmt, step.report.custom_calls)
        kernels[fmt] = step.report.launches.kernels
    assert kernels["int4-act"] == kernels["int4"], kernels


# SmolLM2-sized weights in the model's fused layouts: qkv [E, Hkv, G+2, D], gate_up [E, 2, F],
# down [F, E], and the tied embedding [V, E] as LM head (`dense_transposed`).
TPU_WEIGHTS = {
    "qkv": ((576, 3, 5, 64), 0),
    "gate_up": ((576, 2, 1536), 0),
    "down": ((1536, 576), 0),
    "lm_head": ((8192, 576), 1),
}


def _abstract_weight(fmt: str, shape: tuple[int, ...], axis: int):
    import jax.numpy as jnp

    from jaxinfer.quantization import QArray

    groups = shape[axis] // 128 if fmt == "int8" or axis else shape[axis] // 64
    scale_shape = tuple(groups if i == axis else n for i, n in enumerate(shape))
    if fmt == "int8" or axis:  # NOTE: int4 keeps the vocabulary-sized weights in int8
        return QArray(
            jax.ShapeDtypeStruct(shape, jnp.int8), jax.ShapeDtypeStruct(scale_shape, jnp.float32)
        )
    s = jax.ShapeDtypeStruct(scale_shape, jnp.float16)
    # "int4-act": a GPTQ act-order weight, x gathered through its permutation first
    perm = jax.ShapeDtypeStruct((shape[0],), jnp.int32) if fmt.endswith("-act") else None
    return QArray(jax.ShapeDtypeStruct(shape, jnp.uint4), s, s, perm)


@pytest.mark.parametrize("fmt", ["int8", "int4", "int4-act"])
def test_v5e_one_row_products_read_the_codes_in_place(fmt):
    """XLA:TPU converted whole weights to f32 in HBM for 1-row products (BENCHMARKS.md, issue 35
    "TPU v5e"); `layers.dense` pads such rows to `TPU_MIN_ROWS` and keeps fused layouts unflattened."""
    reason = aot.available("tpu")
    if reason is not None:
        pytest.skip(f"no deviceless tpu compiler: {reason}")
    import jax.numpy as jnp

    from jaxinfer import layers

    found = {}
    for name, (shape, axis) in TPU_WEIGHTS.items():
        w = _abstract_weight(fmt, shape, axis)
        x = jax.ShapeDtypeStruct((1, shape[axis]), jnp.bfloat16)  # one decode row
        if axis:
            fn = lambda x, w: layers.dense_transposed(x, w)  # noqa: E731
        else:
            fn = lambda x, w: layers.dense(x, w)[0]  # noqa: E731
        compiled = aot.compile_function(fn, (x, w), "v5e:1x1")
        found[name] = intermediates.weight_sized(compiled.as_text())
    assert found == {name: [] for name in TPU_WEIGHTS}
