"""Deviceless H100 compiles of a quantized Llama-3-8B-shaped step: no weight-sized intermediate.

XLA's own int8 / int4 products materialize a float copy of the weight (or, at one row, a
weight-sized f32 partial product) before the GEMM; the linear backend `auto` picks the Pallas
dequantizing matmul on a GPU target (`pallas_kernels.linear.gpu`), which reads the codes in their
bits. `jaxinfer.aot.intermediates.weight_sized` finds such intermediates in the optimized HLO.
One 1-token int4 step (2 layers, 8B's projection shapes, a small vocabulary to keep the compile
cheap; its embedding and LM head are int8, so both code types run the kernel: the int8 step's
verdict is the same, measured by the BENCHMARKS.md command, left out of the suite for its time);
skipped without the CUDA plugin. BENCHMARKS.md ("int4 / int8 on a GPU target")
has the before/after numbers.
"""

import json

import pytest

jax = pytest.importorskip("jax")

from jaxinfer import aot  # noqa: E402
from jaxinfer.aot import intermediates  # noqa: E402

LLAMA_8B = "scripts/configs/llama-3-8b/config.json"
BUDGET = dict(tokens=(1,), max_num_seqs=4, max_model_len=256, num_pages=32, page_size=16)


def test_h100_int4_step_reads_the_codes_in_place():
    reason = aot.available("gpu")
    if reason is not None:
        pytest.skip(f"no deviceless gpu compiler: {reason}")
    with open(LLAMA_8B) as f:
        cfg = {**json.load(f), "num_hidden_layers": 2, "vocab_size": 1024}
    (step,) = aot.compile_step(cfg, "h100", quantization="int4", attention_backend="auto", **BUDGET)
    assert step.report.linear_backend == "gpu"
    text = step.compiled.as_text()
    assert intermediates.weight_sized(text) == []
    # one Triton call per projection (qkv, o, gate_up, down) and the one-token step's decode-only
    # attention (its kernel and its split-K merge) per layer, plus the LM head
    assert step.report.pallas_calls == 2 * (4 + 2) + 1, step.report.custom_calls
