"""Compile the engine's step programs for an accelerator this machine does not have.

XLA compiles for a device it cannot see ("deviceless AOT"): the CUDA plugin for an H100 (from
XLA's H100 SXM target description), libtpu for TPU v4/v5e/v5p/v6e slices. This module builds the
engine's own `ModelRunner` over abstract weights on such a target and compiles its step
programs, so the GPU and TPU paths are checked (and measured) on a CPU machine.

1. `get_target(name)` (`targets`): "h100", "h100x8", "v5e:1x1", "v6e:2x2", "v5e:2x4", ...: the
   topology's devices and the HBM of one. JAX must run on the CPU platform (`JAX_PLATFORMS=cpu`
   before it starts) with the plugins installed (`pip install -e '.[aot]'`).
2. `compile_step(model, target, ...)` reads the model's config (a model directory, a GGUF file
   or a `config.json`; `layers=` keeps the first N layers), declares its weights as
   `jax.ShapeDtypeStruct`s placed by the sharding rules on the target's devices (nothing is
   allocated: `load_format="dummy"` without the numbers), and sizes the KV cache as the engine
   does on that device (`num_pages=None`: 85% of the HBM the weights leave, at most what
   `max_num_seqs` full-length sequences need).
3. A model that cannot fit one device's HBM is refused before anything compiles (`DoesNotFit`,
   naming the numbers): with `num_pages` given, when weights + KV cache + penalty rows exceed
   it; sized as the engine does, when the HBM the weights leave holds no full-length
   (`max_model_len`) sequence. A compile that runs out of HBM (temporaries) raises it too.
4. Inside `pallas_kernels.target.use_target(<a target device>)` it builds the engine's
   `ModelRunner(abstract=True)` with the engine options that shape programs (token buckets, max
   seqs, pages, page size, dtype, quantization, kv cache dtype, mesh, attention backend), so the
   kernel choice and interpret mode follow the target's platform, never the CPU JAX runs on;
   then `runner.lower(tokens)` and `.compile()` per token bucket (for a GPU with `xla_dump_to`,
   for the thunk sequence).
5. Each `CompiledStep` holds the compiled program and its `StepReport`: lower/compile seconds,
   per-device weight/KV bytes, XLA's memory analysis (argument, output, temp bytes: does it fit
   the HBM?), cost analysis (flops, bytes accessed: TPU; none on GPU), Pallas calls and other
   custom calls, collectives per layer,
   and on a GPU the launches per step (`report.launches`: kernels, memory ops, loops and
   conditionals, per layer and per named scope).

`compile_function(fn, args, target)` compiles any other function (a kernel) the same way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np

from jaxinfer import params as params_lib
from jaxinfer import sharding as shd
from jaxinfer.aot import report
from jaxinfer.aot.targets import Target, available, bytes_per_device, get_target
from jaxinfer.config import ModelConfig
from jaxinfer.models import family_of
from pallas_kernels.target import use_target

__all__ = [
    "CompiledStep",
    "DoesNotFit",
    "StepReport",
    "Target",
    "available",
    "compile_function",
    "compile_step",
    "get_target",
    "model_config",
]

KV_MEMORY_FRACTION = 0.85  # of the HBM the weights leave, as `EngineCore` sizes the KV cache


class DoesNotFit(ValueError):
    """The model (weights + KV cache + penalty rows) exceeds one target device's HBM."""


@dataclasses.dataclass
class StepReport:
    """One step program on one target (step 5 of the module docstring). Bytes are per device."""

    target: str
    device_kind: str
    num_devices: int  # the program's (a target's first device without a mesh)
    mesh: dict[str, int]
    tokens: int  # the token bucket
    seqs: int  # its sequence bucket
    page_bucket: int
    attention_backend: str
    linear_backend: str
    lower_s: float
    compile_s: float
    hbm_bytes: int
    weight_bytes: int
    kv_cache_bytes: int
    num_pages: int
    memory: dict[str, int]  # XLA's memory analysis: argument/output/alias/temp bytes
    peak_bytes: int  # argument + output - alias + temp
    cost: dict[str, float]  # XLA's cost analysis (flops, bytes accessed); {} where none
    pallas_calls: int  # Pallas kernel calls (Mosaic on TPU, Triton on GPU)
    custom_calls: dict[str, int]  # custom-call target -> count (Pallas ones included)
    collectives: dict[str, dict[str, Any]]
    launches: report.Launches | None  # GPU only

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.hbm_bytes

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["fits"] = self.fits
        return out


@dataclasses.dataclass
class CompiledStep:
    compiled: jax.stages.Compiled
    report: StepReport


def model_config(model: str | os.PathLike | dict, layers: int | None = None) -> ModelConfig:
    """The `ModelConfig` of a model directory, GGUF file or `config.json` path (or an HF-style
    config dict); `layers` keeps the first N layers."""
    if isinstance(model, dict):
        hf = dict(model)
    elif str(model).endswith(".json"):
        with open(model) as f:
            hf = json.load(f)
    else:
        from jaxinfer.model_info import dummy_source

        hf, _ = dummy_source(os.fspath(model), skip_tokenizer_init=True)
    if layers is not None:
        if layers < 1:
            raise ValueError(f"layers must be >= 1, got {layers}")
        hf = {**hf, "num_hidden_layers": layers}
    return ModelConfig.from_hf(hf)


def compile_step(
    model: str | os.PathLike | dict | ModelConfig,
    target: str | Target,
    *,
    tokens: Sequence[int] = (1,),
    layers: int | None = None,
    dtype: str = "bfloat16",
    quantization: str | None = None,
    kv_cache_dtype: str = "auto",
    page_size: int = 16,
    num_pages: int | None = None,
    max_model_len: int | None = None,
    max_num_seqs: int = 64,
    page_bucket: int | None = None,
    mesh: str = "",
    attention_backend: str | None = None,
    linear_backend: str | None = None,
    all_logits: bool = False,
    dump_dir: str | None = None,
    compiler_options: dict[str, Any] | None = None,
    lora: tuple[int, int] | None = None,
    decode_only: bool = False,
    num_scheduler_steps: int = 1,
) -> list[CompiledStep]:
    """Compiles the engine's step program of each token bucket in `tokens` for `target` (see the
    module docstring); raises `DoesNotFit` before compiling when the model exceeds one device's
    HBM. `dump_dir` keeps XLA's dumps (one subdirectory per bucket; GPU targets always dump,
    into a temporary directory otherwise). `lora` (max_loras, max_lora_rank) compiles the programs
    of an engine with enable_lora (every projection with its adapter stacks). `decode_only`
    compiles each bucket's pure-decode program (`StepInputs.decode_only`: every sequence decodes
    one token), the one a decode step runs with the `gpu` attention backend.
    `num_scheduler_steps` > 1 compiles each bucket's multi-step program instead (no data /
    pipeline axes:
    up to that many decode steps in one program, `EngineConfig.num_scheduler_steps`)."""
    from jaxinfer.engine.runner import ModelRunner  # NOTE: the engine's own runner and programs

    tgt = get_target(target) if isinstance(target, str) else target
    cfg = model if isinstance(model, ModelConfig) else model_config(model, layers)
    max_model_len = max_model_len or cfg.max_position_embeddings
    tokens = tuple(sorted(set(tokens)))
    sizes = shd.check_mesh(
        cfg, mesh, num_devices=tgt.num_devices, max_num_seqs=max_num_seqs, num_pages=num_pages
    )
    if sizes[shd.PIPELINE] > 1:
        raise ValueError("jaxinfer.aot compiles no pipeline stages (mesh pipeline > 1)")
    mesh_obj = shd.make_mesh(mesh or None, devices=tgt.devices)
    par = shd.Parallel.from_mesh(mesh_obj)
    family = family_of(cfg)
    specs = family.param_specs(cfg, params_lib.DTYPES[dtype], quantization)
    params = params_lib.abstract(specs, mesh_obj, shd.model_rules(cfg, par))
    num_pages = _num_pages(
        cfg,
        tgt,
        params,
        par,
        dtype,
        kv_cache_dtype,
        page_size,
        num_pages,
        max_model_len,
        max_num_seqs,
    )
    with use_target(tgt.devices[0]), _not_cached():
        runner = ModelRunner(
            cfg,
            params,
            page_size=page_size,
            num_pages=num_pages,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=tokens[-1],
            dtype=dtype,
            attention_backend=attention_backend,
            linear_backend=linear_backend,
            token_buckets=tokens,
            mesh=mesh_obj,
            kv_cache_dtype=kv_cache_dtype,
            abstract=True,
            lora=None if lora is None else (*lora, None),
            num_scheduler_steps=num_scheduler_steps,
        )
        state = runner.device_state
        weights, kv = bytes_per_device(state.params), bytes_per_device(state.kv_caches)
        _check_fits(cfg, tgt, weights, kv, bytes_per_device(state.state), num_pages, mesh)
        common = (all_logits, page_bucket, weights, kv, num_pages, dump_dir, compiler_options or {})
        return [
            _compile_bucket(runner, tgt, t, *common, decode_only, num_scheduler_steps)
            for t in tokens
        ]


@contextlib.contextmanager
def _not_cached() -> Iterator[None]:
    """Keeps these programs out of JAX's persistent compilation cache (no writes, so no later
    hits): a hit would skip the compile that the report times and the dumps it reads."""
    key = "jax_persistent_cache_min_compile_time_secs"
    before = getattr(jax.config, key)
    jax.config.update(key, 1e9)
    try:
        yield
    finally:
        jax.config.update(key, before)


def _num_pages(
    cfg, tgt, params, par, dtype, kv_cache_dtype, page_size, num_pages, max_model_len, max_num_seqs
) -> int:
    """`num_pages`, or as `EngineCore` sizes the cache on the target (step 2)."""
    if num_pages is not None:
        return num_pages
    itemsize = params_lib.DTYPES[dtype].dtype.itemsize
    page_bytes = page_size * family_of(cfg).kv_cache_bytes_per_token(
        cfg, par, itemsize, kv_cache_dtype
    )
    weights = bytes_per_device(params)
    budget = max(0, int(KV_MEMORY_FRACTION * (tgt.hbm_bytes - weights)))
    pages_per_seq = -(-max_model_len // page_size)
    if budget // page_bytes < pages_per_seq + 1:
        raise DoesNotFit(
            f"{_gb(weights)} of weights per device leave {_gb(budget)} for the KV cache "
            f"({KV_MEMORY_FRACTION:.0%} of the rest of {_gb(tgt.hbm_bytes)} HBM of one "
            f"{tgt.device_kind}, {tgt.name}): {budget // page_bytes * page_size} tokens, less than "
            f"one max_model_len={max_model_len} sequence; use a mesh that splits the weights, "
            f"quantization, a smaller max_model_len or a larger target"
        )
    pages_for_all = (max_num_seqs // par.data) * pages_per_seq + 1
    return int(min(budget // page_bytes, pages_for_all)) * par.data


def _check_fits(cfg, tgt, weights, kv, state, num_pages, mesh) -> None:
    need = weights + kv + state
    if need > tgt.hbm_bytes:
        raise DoesNotFit(
            f"the model needs {_gb(need)} per device ({_gb(weights)} weights + {_gb(kv)} KV "
            f"cache of {num_pages} pages + {_gb(state)} penalty rows) > {_gb(tgt.hbm_bytes)} HBM "
            f"of one {tgt.device_kind} ({tgt.name}, mesh {mesh or 'single device'}); use a mesh "
            f"that splits it, quantization, a smaller num_pages or a larger target"
        )


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def _compile_bucket(
    runner,
    tgt,
    t,
    all_logits,
    page_bucket,
    weights,
    kv,
    num_pages,
    dump_dir,
    options,
    decode,
    steps,
) -> CompiledStep:
    start = time.perf_counter()
    # NOTE: a one-token step is a decode without the mark (`StepInputs.decode_only`), as it runs
    lowered = runner.lower(
        t, all_logits, page_bucket, decode_only=decode and t > 1, num_steps=steps
    )
    lower_s = time.perf_counter() - start
    dump = None
    if tgt.platform == "gpu" or dump_dir:
        dump = (
            os.path.join(dump_dir, f"tokens_{t}") if dump_dir else tempfile.mkdtemp(prefix="aot_")
        )
        options = {"xla_dump_to": dump, **options}
    try:
        start = time.perf_counter()
        try:
            compiled = lowered.compile(compiler_options=options)
        except jax.errors.JaxRuntimeError as e:
            if "RESOURCE_EXHAUSTED" in str(e) and "HBM" in str(e):
                raise DoesNotFit(
                    f"{tgt.name}, tokens {t}: {_gb(weights)} weights + {_gb(kv)} KV cache of "
                    f"{num_pages} pages per device compile out of HBM: {e}"
                ) from e
            raise
        compile_s = time.perf_counter() - start
        ops = report.hlo_ops(compiled.as_text())
        launches = report.launches(dump, ops) if tgt.platform == "gpu" else None
    finally:
        if dump and not dump_dir:
            shutil.rmtree(dump, ignore_errors=True)
    mem = compiled.memory_analysis()
    memory = {
        k: int(getattr(mem, f"{k}_size_in_bytes", 0) or 0)
        for k in ("argument", "output", "alias", "temp", "generated_code")
    }
    mesh = runner.mesh
    return CompiledStep(
        compiled,
        StepReport(
            target=tgt.name,
            device_kind=tgt.device_kind,
            num_devices=1 if mesh is None else int(mesh.size),
            mesh={} if mesh is None else {k: int(v) for k, v in mesh.shape.items() if v > 1},
            tokens=t,
            seqs=runner.buckets.seq_bucket(t),
            page_bucket=page_bucket or runner.pages_per_seq,
            attention_backend=runner.attention_backend,
            linear_backend=runner.linear_backend,
            lower_s=round(lower_s, 2),
            compile_s=round(compile_s, 2),
            hbm_bytes=tgt.hbm_bytes,
            weight_bytes=weights,
            kv_cache_bytes=kv,
            num_pages=num_pages,
            memory=memory,
            peak_bytes=memory["argument"] + memory["output"] - memory["alias"] + memory["temp"],
            cost=_cost(compiled),
            pallas_calls=report.pallas_calls(ops),
            custom_calls=report.custom_calls(ops),
            collectives=report.collectives(ops, runner.cfg.num_layers),
            launches=launches,
        ),
    )


def _cost(compiled: jax.stages.Compiled) -> dict[str, float]:
    cost = compiled.cost_analysis()
    if isinstance(cost, list | tuple):
        cost = cost[0] if cost else None
    if not cost:
        return {}
    keep = ("flops", "bytes accessed", "transcendentals")
    return {k: float(cost[k]) for k in keep if k in cost}


def compile_function(
    fn: Callable,
    args: Sequence[Any],
    target: str | Target,
    *,
    static_kwargs: dict[str, Any] | None = None,
    compiler_options: dict[str, Any] | None = None,
) -> jax.stages.Compiled:
    """`jax.jit(fn)` compiled for one device of `target` over `args` (arrays or
    `jax.ShapeDtypeStruct`s, placed on that device), kernels and interpret mode chosen for the
    target's platform."""
    tgt = get_target(target) if isinstance(target, str) else target
    sharding = jax.sharding.SingleDeviceSharding(tgt.devices[0])
    structs = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding), args
    )
    with use_target(tgt.devices[0]), _not_cached():
        jitted = jax.jit(lambda *a: fn(*a, **(static_kwargs or {})))
        return jitted.lower(*structs).compile(compiler_options=compiler_options or {})
