"""Deviceless compiles of whole engine steps for an H100 and a TPU v5e (`jaxinfer.aot`).

Each accelerator gets one 2-layer step program on one device and one tensor-parallel program on
several (H100 x2, v5e 2x2), compiled by the target's own compiler (ptxas for sm_90a, Mosaic +
the TPU backend) from the engine's real runner; module-scoped fixtures compile each once and
the tests read their reports. Skipped where the CUDA plugin / libtpu are absent
(`pip install -e '.[aot]'`). The HBM refusal and the report script need no compile.
"""

import math
import re

import pytest

jax = pytest.importorskip("jax")

from jaxinfer import aot  # noqa: E402
from jaxinfer.aot import report  # noqa: E402
from tests.script_utils import script  # noqa: E402

# 2 layers, head_dim 128 (the TPU lane width), KV heads replicated on 4 tensor shards.
SMALL = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}
# SmolLM2-135M with 2 of its 30 layers, cache sized for 4 sequences of 2048 tokens (513 pages of
# 16, 6.3 MB a layer): XLA's default TPU layout copied this cache (head_dim 64, 3 KV heads) whole
# on every call before the TPU kernel got its own layout (`tpu_layout`), and XLA's scatter write
# moved it whole into VMEM and back before the write became a kernel (`tpu_write`).
SMOLLM2 = "scripts/configs/smollm2-135m/config.json"
SMOLLM2_BUDGET = dict(tokens=(1,), layers=2, max_num_seqs=4, max_model_len=2048, page_size=16)
BUDGET = dict(tokens=(1,), max_num_seqs=4, max_model_len=256, num_pages=32, page_size=16)
LLAMA_8B = "scripts/configs/llama-3-8b/config.json"


def _needs(platform: str) -> None:
    reason = aot.available(platform)
    if reason is not None:
        pytest.skip(f"no deviceless {platform} compiler: {reason}")


def _compiled(target: str, mesh: str = "") -> aot.CompiledStep:
    _needs("gpu" if target.startswith("h100") else "tpu")
    (step,) = aot.compile_step(SMALL, target, mesh=mesh, attention_backend="auto", **BUDGET)
    return step


def _step(target: str, mesh: str = "") -> aot.StepReport:
    return _compiled(target, mesh).report


@pytest.fixture(scope="module")
def h100() -> aot.StepReport:
    return _step("h100")


@pytest.fixture(scope="module")
def v5e_step() -> aot.CompiledStep:
    _needs("tpu")
    (step,) = aot.compile_step(SMOLLM2, "v5e:1x1", attention_backend="auto", **SMOLLM2_BUDGET)
    return step


@pytest.fixture(scope="module")
def v5e(v5e_step) -> aot.StepReport:
    return v5e_step.report


def test_h100_step_runs_the_triton_kernel_per_layer(h100):
    assert jax.default_backend() == "cpu"  # NOTE: the kernel follows the target, not JAX's
    assert h100.attention_backend == "gpu" and h100.device_kind == "NVIDIA H100 80GB HBM3"
    # a one-token step takes the decode-only path: per layer one Triton attention kernel (RoPE and
    # the KV write inside, gpu_decode_qkv) and one split-K merge, and the residual adds ride in
    # the RMSNorm kernels (one in layer 0, two in layer 1: 7 Triton calls), none interpreted
    assert h100.pallas_calls == 7 and h100.custom_calls == {"__gpu$xla.gpu.triton": 7}
    launches = h100.launches
    assert launches.kernels > 0 and launches.loops + launches.conditionals > 0
    assert {"layer_0", "layer_1"} <= set(launches.per_layer)
    layers = [v for k, v in launches.per_layer.items() if k.startswith("layer_")]
    assert max(layers) <= H100_DECODE_LAYER_KERNELS, launches.per_layer
    assert launches.per_scope.get("attention/paged_attention", 0) >= 2
    assert h100.memory["temp"] > 0 and h100.fits


def test_v5e_step_runs_the_mosaic_kernel_per_layer(v5e):
    assert v5e.attention_backend == "tpu" and v5e.device_kind == "TPU v5 lite"
    # per layer the in-place KV write (`tpu_write`) and the attention kernel
    assert v5e.custom_calls.get("tpu_custom_call") == v5e.pallas_calls == 4
    assert v5e.cost["flops"] > 0 and v5e.cost["bytes accessed"] > 0
    assert v5e.launches is None and v5e.fits


def test_v5e_decode_step_reads_the_cache_in_place(v5e_step):
    """No copy in the optimized HLO of a SmolLM2 decode step moves a layer's KV cache: neither a
    `copy` (XLA's default TPU layout for this cache, page axis minor-most, used to be re-laid-out
    whole on every call) nor a `copy-start` (XLA's scatter write of one token had memory-space
    assignment move this cache whole into VMEM and back, every layer, every step; the write is
    now `tpu_write`'s in-place kernel); the step accesses <= 2x its weights + KV bytes (issue 30:
    179.3 MB for 83.4 MB before the write kernel, 2.15x). BENCHMARKS.md, "Deviceless compiles"."""
    r = v5e_step.report
    assert _copies(v5e_step.compiled), "no copy at all: the pattern no longer matches XLA's text"
    assert not _cache_copies(v5e_step.compiled)
    assert r.cost["bytes accessed"] <= 2 * (r.weight_bytes + r.kv_cache_bytes), r.cost


def _copies(compiled) -> list[tuple[str, str]]:
    """(result shapes, line) of every copy / copy-start in the optimized HLO."""
    out = []
    for line in compiled.as_text().splitlines():
        op = re.search(r" copy(-start)?\(", line)
        if op:  # the result's shapes: between the name and the op
            out.append((line[: op.start()].split("=", 1)[-1], line.strip()[:160]))
    return out


def _cache_copies(compiled) -> list[str]:
    """Copies of a SmolLM2 layer's TPU cache [pages, 3 KV heads, 16 slots, 128 lanes (K and V of
    head_dim 64)]."""
    return [line for shapes, line in _copies(compiled) if re.search(r"\[\d+,3,16,128\]", shapes)]


def _big_copies(compiled, elements: int = 1 << 14) -> list[str]:
    """Copies in the optimized HLO of an array of >= `elements` values (a KV cache or a weight;
    a step's own small arrays are far below)."""
    big = []
    for shapes, line in _copies(compiled):
        dims = re.search(r"\[([\d,]+)\]", shapes)
        if dims and math.prod(int(d) for d in dims.group(1).split(",")) >= elements:
            big.append(line)
    return big


def test_multi_step_programs_loop_in_one_launch_without_copies():
    """`num_scheduler_steps` 4 (`programs.burst_program`: the decode steps in one device loop):
    on an H100 the whole program, its loop included, is still one command buffer (one host
    launch for all its steps); on a v5e, as on the H100 and two H100s (`tensor=2`), the loop
    copies no KV cache or weight (the loop carries the caches in place)."""
    _needs("gpu")
    (gpu,) = aot.compile_step(
        SMALL, "h100", attention_backend="auto", num_scheduler_steps=4, **BUDGET
    )
    assert "burst/while" in gpu.compiled.as_text()
    launches = gpu.report.launches
    assert set(launches.host_thunks) == {"kCommandBuffer"}, launches.host_thunks
    assert launches.host_launches == H100_HOST_LAUNCHES
    assert not _big_copies(gpu.compiled)
    # tensor parallel: the loop's steps all-reduce like single steps, no copies either
    (tp,) = aot.compile_step(
        SMALL, "h100x2", mesh="tensor=2", attention_backend="auto", num_scheduler_steps=4, **BUDGET
    )
    assert tp.report.collectives["all-reduce"]["per_layer"] >= 2 and not _big_copies(tp.compiled)
    _needs("tpu")
    (tpu,) = aot.compile_step(
        SMOLLM2, "v5e:1x1", attention_backend="auto", num_scheduler_steps=4, **SMOLLM2_BUDGET
    )
    # one step in the loop: the KV write and attention kernels of its 2 layers, once
    assert "/burst/" in tpu.compiled.as_text() and tpu.report.pallas_calls == 4
    # (memory-space assignment prefetches weights into VMEM on a TPU: copies, but no cache's)
    assert not _cache_copies(tpu.compiled)


@pytest.mark.parametrize("target", ["h100x2", "v5e:2x2"])
def test_tensor_parallel_step_all_reduces_twice_per_layer(target):
    shards = 2 if target == "h100x2" else 4
    r = _step(target, f"tensor={shards}")
    assert r.num_devices == shards and r.mesh == {"tensor": shards}
    # attention's o_proj and the MLP's down projection each leave partial sums per layer
    assert r.collectives["all-reduce"]["per_layer"] == 2
    # GPU: a one-token step's decode kernel and its split-K merge (gpu_decode_qkv) in each layer,
    # and 3 add + RMSNorm kernels; TPU: the KV write kernel and the attention kernel in each layer
    assert r.pallas_calls == (7 if target == "h100x2" else 4)
    embed = SMALL["vocab_size"] * SMALL["hidden_size"] * 2  # bf16, split over the shards
    assert r.weight_bytes < 2 * embed + 2 * _layer_bytes() // shards * 2
    if target == "h100x2":
        assert r.launches.collectives > 0


def _layer_bytes() -> int:
    h, f, d = SMALL["hidden_size"], SMALL["intermediate_size"], SMALL["head_dim"]
    q, kv = SMALL["num_attention_heads"] * d, SMALL["num_key_value_heads"] * d
    return 2 * (h * (q + 2 * kv) + q * h + 3 * h * f)


def test_a_model_too_big_for_the_hbm_is_refused_before_compiling(monkeypatch):
    _needs("tpu")
    from jaxinfer.engine.runner import ModelRunner

    monkeypatch.setattr(ModelRunner, "lower", lambda *a, **k: pytest.fail("compiled"))
    # Llama-3-8B in bf16 on a v5e (15.75 GiB): the KV cache left holds no 8192-token sequence
    with pytest.raises(
        aot.DoesNotFit,
        match=r"16\.06 GB of weights per device leave 0\.72 GB for the KV cache .* 16\.91 GB HBM "
        r"of one TPU v5 lite, v5e:1x1\): 5504 tokens, less than one max_model_len=8192",
    ):
        aot.compile_step(LLAMA_8B, "v5e:1x1", tokens=(1,))
    # a v6e (31.25 GiB) holds the weights, not 10000 pages of KV cache besides
    with pytest.raises(
        aot.DoesNotFit,
        match=r"needs 37\.\d\d GB per device \(16\.06 GB weights \+ 20\.97 GB KV cache of 10000 "
        r"pages \+ 0\.04 GB penalty rows\) > 33\.55 GB HBM of one TPU v6 lite",
    ):
        aot.compile_step(LLAMA_8B, "v6e:1x1", tokens=(1,), num_pages=10000)


def test_report_script_prints_a_table_and_refuses_with_status_2(h100, capsys):
    aot_report = script("aot_report")
    text = aot_report.table([aot_report.row(h100)])
    assert "| h100 | 1 device | 1 | 1 |" in text
    _needs("tpu")
    assert aot_report.main(["--target", "v5e:1x1", "--config", LLAMA_8B]) == 2
    assert "refused: " in capsys.readouterr().err


def test_scopes_come_from_named_scopes_inside_jax_frames():
    name = "jit(step_program)/shard_map/layer_3/attention/paged_attention/jit(rpa)/x/gather"
    assert report.scope_of(name) == ("layer_3", "attention/paged_attention")
    assert report.scope_of("jit(step_program)/sampler/cond/branch_1_fun/top_k") == (
        None,
        "sampler",
    )


def test_compile_function_places_its_arguments_on_the_target():
    _needs("tpu")
    import jax.numpy as jnp

    x = jax.ShapeDtypeStruct((8, 128), jnp.float32)
    compiled = aot.compile_function(lambda a, *, k: a * k, [x], "v5e:1x1", static_kwargs={"k": 2})
    assert compiled.memory_analysis().argument_size_in_bytes == 8 * 128 * 4
    (device,) = compiled.input_shardings[0][0].device_set
    assert device.platform == "tpu"


# Issue 31's launch budget of a 2-layer step of 16 tokens (both query classes: decode and
# prefill) on an H100, counted from XLA's thunk sequence: kernels per layer, the sampler group's
# kernels outside conditionals (what a greedy step without edits launches), and the host-level
# launches (command buffers, conditionals, loops, kernels left outside a graph) with no loop at
# the top level; and of the same bucket's pure-decode program (`StepInputs.decode_only`).
# BENCHMARKS.md, "GPU decode step launches", has the 8B-shaped numbers before and after.
# NOTE: since 2026-11-26 the Triton GEMM fusions XLA leaves without an op name count in their
# layer (`report.scoped_op_names`; they counted outside the layers before), so these constants
# count the GEMMs too.
H100_LAYER_KERNELS = 24  # layer 0 also builds the attention work tables the layers share
# A one-token step (always a decode: the kernel's decode-only path, gpu_decode): 25 before the
# fused QKV weight, 24 after (old counting); 15 with the decode-only path (one attention launch and
# one split-K merge instead of both query classes, gathers, 3 combine scatters and a select); 12
# with RoPE and the KV write inside the attention kernel (gpu_decode_qkv), the residual adds in
# the RMSNorm kernels (rms_norm.gpu) and no split-K GEMMs (layer 0, which also holds the first
# norm as reduce + convert; layer 1: 10).
H100_DECODE_LAYER_KERNELS = 12
H100_DECODE_BATCH_LAYER_KERNELS = 10  # the 16-token pure-decode program (12 before the fusions)
# 11 (16 before the sampler's fast-path predicate came from the host: BatchExtras.sample_staged;
# 12 in the pure-decode program)
H100_SAMPLER_GROUP_KERNELS = 11
H100_HOST_LAUNCHES = 1  # the whole step is one command buffer (programs.compiler_options)


def test_h100_step_launch_budget():
    _needs("gpu")
    budget = {**BUDGET, "tokens": (16,)}
    (step,) = aot.compile_step(SMALL, "h100", attention_backend="auto", **budget)
    launches = step.report.launches
    layers = [v for k, v in launches.per_layer.items() if k.startswith("layer_")]
    group = sum(
        launches.per_scope_unconditional.get(f"{s} (outside layers)", 0)
        for s in ("sampler", "penalty_state", "logits")
    )
    assert layers and max(layers) <= H100_LAYER_KERNELS, launches.per_layer
    assert 0 < group <= H100_SAMPLER_GROUP_KERNELS, launches.per_scope_unconditional
    # NOTE: a conditional or loop outside the command buffer makes the host wait for the device
    # (XLA reads its predicate on the host): the step's launch would return only once the device
    # had run the forward (an H200 decode step took 10.6 ms instead of 5.75; BENCHMARKS.md)
    assert set(launches.host_thunks) == {"kCommandBuffer"}, launches.host_thunks
    assert launches.host_launches == H100_HOST_LAUNCHES, launches.host_thunks
    (decode,) = aot.compile_step(
        SMALL, "h100", attention_backend="auto", decode_only=True, **budget
    )
    launches = decode.report.launches
    layers = [v for k, v in launches.per_layer.items() if k.startswith("layer_")]
    assert max(layers) <= H100_DECODE_BATCH_LAYER_KERNELS, launches.per_layer
    assert launches.host_launches == H100_HOST_LAUNCHES, launches.host_thunks


# Issue 34's LoRA launches: the kernels an engine with enable_lora (4 slots, rank 16, every target)
# adds per layer to the 1-token H100 step, against `h100`'s step without LoRA: one Pallas launch
# per projection input (`pallas_kernels.lora.gpu`), nothing else. XLA's einsums gave 16; the
# kernel adding in place everywhere gave 4 at 1 token but 8 at 64 (each split-K base GEMM's
# reduction became a launch of its own), returning the delta everywhere 5 and 5; measured
# 2026-11-26 (jax 0.10.2), BENCHMARKS.md "Multi-LoRA launches per layer".
H100_LORA_LAYER_KERNELS = 4


def test_h100_lora_kernels_per_layer(h100):
    _needs("gpu")
    (step,) = aot.compile_step(SMALL, "h100", attention_backend="auto", lora=(4, 16), **BUDGET)

    def in_layers(launches) -> int:
        return sum(v for k, v in launches.per_layer.items() if k.startswith("layer_"))

    layers = SMALL["num_hidden_layers"]
    extra = (in_layers(step.report.launches) - in_layers(h100.launches)) / layers
    assert 0 < extra <= H100_LORA_LAYER_KERNELS, (extra, step.report.launches.per_scope)
