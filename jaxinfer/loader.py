"""Load a model from any supported source into a params tree on devices.

1. `jaxinfer.model_info` (no JAX) resolves the path (`resolve_model_path(None)` is the embedded
   default), recognises the source (`open_source`: GGUF file, orbax checkpoint dir written by
   `scripts/convert.py`, or Hugging Face dir) and reads its config and tokenizer; `LoadedModel`
   is the record both modules return.
2. `load_model(path)` checks its arguments before anything is read, then takes step 3 (step 4
   with `load_format="dummy"`).
3. `load_from_source` (what `load_model` calls after step 2; `jaxinfer.convert` calls it with
   the handle it already holds) builds the `ModelConfig` from the source's HF-style config and the
   tokenizer (before any weight is read, so a missing tokenizer fails fast; none at all with
   `skip_tokenizer_init`), then fills the params
   tree tensor by tensor (HF and GGUF sources) or restores it from orbax straight into the target
   shardings. With `quantization` ("int8" | "fp8" | "int4") HF and GGUF tensors are quantized on
   the host as they are read (GGUF block formats requantized row chunk by row chunk, no float32
   copy; a GGUF file of Q4_0 / Q4_1 weights loads "int4" as "int4-g32", its blocks kept exactly), a
   float orbax checkpoint is quantized on device after its restore, and a quantized orbax
   checkpoint restores as it is. On a pipeline mesh the params come back stacked by stage (`jaxinfer.pipeline`):
   orbax restores each layer onto its stage's devices, HF/GGUF tensors are read to the host and
   each device receives only its slices.
4. `load_format="dummy"` (vLLM's name) reads only the source's config (a `config.json`, or a GGUF
   file's metadata) and tokenizer (`Tokenizer.placeholder` when the directory has none), and
   fills the params tree with random weights of the declared shapes and dtype (int8 / fp8 / int4
   leaves with `quantization=`, in the format and groups step 3 would load, a GPTQ / AWQ
   config's own without it)
   (`params.init_on_device`: jitted programs, sharded on the mesh, nothing on the host); the init
   scale (std 0.02, unit norms) keeps logits finite. For benchmarking any architecture without
   its weights.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any

import jax

from checkpoints import quantize as qlib
from checkpoints.errors import CheckpointError
from checkpoints.hf_quant import PackedScheme, PackedView, packed_scheme
from jaxinfer import params as params_lib
from jaxinfer import pipeline
from jaxinfer import quantization as quant
from jaxinfer import sharding as shd
from jaxinfer.config import ModelConfig
from jaxinfer.model_info import (
    LoadedModel,
    check_load_format,
    dummy_source,
    load_tokenizer,
    open_source,
    resolve_model_path,
    source_hf_config,
)
from jaxinfer.models import family_of
from pallas_kernels import target

log = logging.getLogger(__name__)

DUMMY_SEED = 0
# A leaf of the layout before the fused QKV weight (`llama.AttentionParams.qkv`).
_UNFUSED_QKV = re.compile(r"layers\.\d+\.attn\.kv(_bias)?(\.|$)")


def default_dtype() -> str:
    """f32 on CPU (XLA:CPU multiplies bf16 matrices by vectors >10x slower), bf16 on accelerators."""
    return "float32" if target.platform() == "cpu" else "bfloat16"


def _resolve_dtype(dtype: str | None) -> str:
    dtype = dtype or default_dtype()
    if dtype not in params_lib.DTYPES:
        raise ValueError(f"dtype must be one of {sorted(params_lib.DTYPES)}, got {dtype!r}")
    return dtype


def load_model(
    model: str | os.PathLike | None = None,
    *,
    dtype: str | None = None,
    mesh: jax.sharding.Mesh | None = None,
    quantization: str | None = None,
    load_format: str = "auto",
    skip_tokenizer_init: bool = False,
) -> LoadedModel:
    """Loads a GGUF file, a HF dir or an orbax checkpoint dir (None: the embedded default model).

    Args:
      model: the source path, or None for the embedded SmolLM2-135M-Instruct. With
        `load_format="dummy"` a directory holding only `config.json` and the tokenizer files is
        enough.
      dtype: "float32" or "bfloat16"; None is `default_dtype()`.
      mesh: where the params go; None is a one-device mesh.
      quantization: None, "int8", "fp8" or "int4" (`checkpoints.quantize`): store the linear
        weights and the embedding quantized (weight-only), quantized on the host as they are read
        (GGUF blocks requantized without a float32 copy of the tensor). None loads the source's
        own format, as vLLM: an orbax checkpoint saved quantized, a GPTQ / AWQ one packed, a
        GGUF file in its own bits (int4 or int8 in its blocks' groups, `_gguf_format`), a float
        checkpoint as floats; vLLM's names "gptq" / "awq" (and their "_marlin" variants) and
        "gguf" ask for that format and refuse any other checkpoint; "none" (`qlib.FLOAT`) loads
        a GGUF file's blocks dequantized to `dtype`. With `load_format="dummy"` the random
        weights are created quantized, in the groups the real load would take.
      load_format: "auto" reads the source's weights; "dummy" creates random weights of the same
        shapes, dtype and shardings on the devices (step 4 of the module docstring).
      skip_tokenizer_init: load no tokenizer (vLLM's name): token ids in and out, so a checkpoint
        without tokenizer files loads; `tokenizer` is then None.

    Returns:
      The config, params (on `mesh`) and tokenizer.
    """
    qlib.check_requested(quantization)  # a bad value fails before anything is read
    check_load_format(load_format)
    path = resolve_model_path(model)
    dtype = _resolve_dtype(dtype)
    if load_format == "dummy":
        return load_dummy(
            path,
            dtype=dtype,
            mesh=mesh,
            quantization=quantization,
            skip_tokenizer_init=skip_tokenizer_init,
        )
    kind, handle = open_source(path)
    return load_from_source(
        path,
        kind,
        handle,
        dtype=dtype,
        mesh=mesh,
        quantization=quantization,
        skip_tokenizer_init=skip_tokenizer_init,
    )


def orbax_quantization(path: str) -> str | None:
    """The format an orbax checkpoint was saved in: None (float), "int8" with its group size and
    act-order as saved ("int8-g32", "int8-g32-act"), or "fp8". A quantized
    one whose scales lack the contraction axis (converted before group-wise scales) is refused,
    and so is one converted before the fused QKV weight (a clear error, not a leaf mismatch)."""
    from checkpoints.orbax_io import saved_leaves  # NOTE: orbax imports in ~1 s: only here

    leaves = saved_leaves(path)
    unfused = next((n for n in leaves if _UNFUSED_QKV.match(n)), None)
    if unfused is not None:
        raise CheckpointError(
            f"{path!r}: leaf {unfused}: a checkpoint converted before 2026-11-26 holds the query "
            f"and K/V projections apart (attn.q, attn.kv); they are now one fused attn.qkv "
            f"[E, Hkv, G+2, D]: convert its source again with scripts/convert.py"
        )
    found = {dtype for name, (_, dtype) in leaves.items() if name.endswith(".data")}
    fmt = next((f for f, dtype in quant.STORAGE.items() if found == {dtype}), None)
    if found and fmt is None:
        raise CheckpointError(
            f"{path!r}: quantized leaves of mixed dtypes {sorted(map(str, found))}"
        )
    for name, (shape, _) in leaves.items():
        data = (
            leaves.get(name.removesuffix(".scale") + ".data") if name.endswith(".scale") else None
        )
        if data is not None and len(shape) != len(data[0]):
            raise CheckpointError(
                f"{path!r}: leaf {name}: checkpoint shape {shape} for data {data[0]}; a {fmt} "
                f"checkpoint converted before 2026-11-24 holds one scale per output channel "
                f"without the contraction axis (now scale groups): convert its float source again"
            )
    if fmt == "int8":  # its group size (and act-order) as saved: e.g. "int8-g32-act" of a GPTQ
        grouped = [
            quant.QArray(jax.ShapeDtypeStruct(shape, dtype), jax.ShapeDtypeStruct(*scale))
            for name, (shape, dtype) in leaves.items()
            if name.endswith(".data")
            and (scale := leaves.get(name.removesuffix(".data") + ".scale")) is not None
        ]
        act = any(name.endswith(".perm") for name in leaves)
        fmt = qlib.format_name(fmt, quant.group_size_of(grouped, fmt), act)
    return fmt


def _packed_quantization(path: str, scheme: PackedScheme, asked: str | None) -> str:
    """The format a GPTQ / AWQ checkpoint loads in (int4, or int8 for 8-bit GPTQ, of its group
    size); `asked` must be None, that format, or its method (`qlib.CHECKPOINT_METHODS`)."""
    if scheme.group_size not in qlib.GROUP_CHOICES:
        raise CheckpointError(
            f"{path!r}: {scheme.method} group_size={scheme.group_size} is not supported "
            f"(supported: {qlib.GROUP_CHOICES})"
        )
    fmt = qlib.format_name(scheme.fmt, scheme.group_size, scheme.act_order)
    if asked not in (None, scheme.fmt, fmt) and qlib.CHECKPOINT_METHODS.get(asked) != scheme.method:
        raise CheckpointError(
            f"{path!r} is a {scheme.method} checkpoint ({scheme.bits}-bit, groups of "
            f"{scheme.group_size}): it loads as quantization={fmt!r} (or None, or "
            f"{scheme.method!r}), not {asked!r}"
        )
    return fmt


def _packed_or_asked(
    path: str, config: dict, asked: str | None
) -> tuple[PackedScheme | None, str | None]:
    """(the GPTQ / AWQ scheme of a HF `config`, or None; the format to load): a name of
    `qlib.CHECKPOINT_METHODS` asks for that scheme's own format and is refused, naming the field,
    for any other checkpoint (vLLM refuses that mismatch too)."""
    scheme = packed_scheme(config)
    if scheme is not None:
        return scheme, _packed_quantization(path, scheme, asked)
    method = qlib.CHECKPOINT_METHODS.get(asked)
    if method not in (None, "gguf"):  # "gguf": `_gguf_format`
        raise CheckpointError(
            f"quantization={asked!r} loads a checkpoint quantized by {method.upper()}, but "
            f"{path!r} has no quantization_config with quant_method={method!r}: ask for None "
            f"(its own weights) or a format to quantize to {qlib.FORMATS}"
        )
    return None, asked


def _check_act_order(path: str, fmt: str | None, own: bool) -> None:
    """An "-act" format names an act-order GPTQ checkpoint's own layout (`own`: the source is one,
    or an orbax copy saved so); asked for anything else it is refused by name."""
    if qlib.act_order(fmt) and not own:
        raise CheckpointError(
            f"quantization={fmt!r}: -act is the layout of an act-order GPTQ checkpoint "
            f"(quantization_config.desc_act=True), which {path!r} is not; drop -act"
        )


def _gguf_format(path: str, kind: str, handle: Any, asked: str | None) -> str | None:
    """The format a source loads `asked` in (`qlib.FLOAT`: None, float weights). A GGUF file
    asked for None loads as "gguf" (vLLM's default for one): its own bits, "int4" when most of
    its layers' values are Q4_0 / Q4_1 / Q4_K blocks (a Q4_K_M file's Q6_K tensors requantize),
    else "int8" when it holds block-quantized tensors, else None (a float file); "gguf" is
    refused for any other source. Then "int4" / "int4-sym" of a file with Q4 blocks keeps them in
    groups of their 32 values, and "int8" of a file of symmetric blocks only (Q8_0 / Q4_0 / Q5_0 /
    Q6_K) takes their groups, exactly."""
    if asked == "gguf" and kind != "gguf":
        raise CheckpointError(
            f"quantization='gguf' loads a GGUF file in its own bits, but {path!r} is not one "
            f"({kind} source)"
        )
    if asked == qlib.FLOAT:
        return None
    if kind != "gguf":
        return asked
    if asked is None or asked == "gguf":
        four = handle.native_int4_share() >= 0.5  # NOTE: so native_int4_groups() is 32
        asked = "int4" if four else "int8" if handle.has_blocks() else None
    if asked in ("int4", "int4-sym") and handle.native_int4_groups():
        asked = asked.replace("int4", f"int4-g{handle.native_int4_groups()}")
        requantized = handle.int4_requantized()
        if requantized:
            log.info(
                "%s: %d tensors of higher-bit GGUF types (e.g. %s) requantize to %s",
                path, len(requantized), requantized[0], asked,
            )  # fmt: skip
    if asked == "int8" and handle.native_int8_groups():
        asked = qlib.format_name("int8", handle.native_int8_groups())
    return asked


def load_dummy(
    path: str,
    *,
    dtype: str | None = None,
    mesh: jax.sharding.Mesh | None = None,
    quantization: str | None = None,
    skip_tokenizer_init: bool = False,
) -> LoadedModel:
    """Step 4 of the module docstring: the source's config and tokenizer, random weights (stored
    quantized when `quantization` is given, and in a GPTQ / AWQ config's own format, as step 3
    loads its weights)."""
    qlib.check_requested(quantization)
    dtype = _resolve_dtype(dtype)
    hf_config, tokenizer = dummy_source(path, skip_tokenizer_init)
    scheme, quantization = _packed_or_asked(path, hf_config, quantization)
    _check_act_order(path, quantization, scheme is not None)
    # a GGUF file's random weights in the groups its own would get
    kind, handle = open_source(path) if os.path.isfile(path) else ("hf", None)
    quantization = _gguf_format(path, kind, handle, quantization)
    cfg = ModelConfig.from_hf(hf_config)
    specs = family_of(cfg).param_specs(cfg, params_lib.DTYPES[dtype], quantization)
    if mesh is None:
        mesh = shd.make_mesh(None)
    rules = shd.model_rules(cfg, shd.Parallel.from_mesh(mesh))
    quant.check_group_splits(specs, mesh, rules)
    key = jax.random.PRNGKey(DUMMY_SEED)
    if dict(mesh.shape).get(shd.PIPELINE, 1) > 1:  # each layer on its stage, then stacked
        targets = pipeline.canonical_targets(specs, mesh, rules)
        params = params_lib.init_on_device(specs, key, jax.tree.map(lambda t: t.sharding, targets))
        params = pipeline.to_stacked(params, specs, mesh, delete_sources=True, rules=rules)
    else:
        params = params_lib.init_on_device(specs, key, params_lib.shardings(specs, mesh, rules))
    name = os.path.basename(os.path.normpath(path))
    return LoadedModel(
        name=name,
        path=path,
        source="dummy",
        cfg=cfg,
        hf_config=hf_config,
        params=params,
        tokenizer=tokenizer,
        dtype=dtype,
        quantization=quantization,
    )


def load_from_source(
    path: str,
    kind: str,
    handle: Any,
    *,
    dtype: str | None = None,
    mesh: jax.sharding.Mesh | None = None,
    quantization: str | None = None,
    skip_tokenizer_init: bool = False,
) -> LoadedModel:
    """Step 3 of the module docstring, for a source `open_source(path)` has opened."""
    qlib.check_requested(quantization)
    dtype = _resolve_dtype(dtype)
    jdtype = params_lib.DTYPES[dtype]
    hf_config = source_hf_config(path, kind, handle)
    cfg = ModelConfig.from_hf(hf_config)
    tokenizer = None if skip_tokenizer_init else load_tokenizer(kind, handle, path)
    # GPTQ / AWQ: its packed linears kept as int4 (checkpoints.hf_quant)
    scheme, quantization = _packed_or_asked(
        path, handle.config if kind == "hf" else {}, quantization
    )
    saved = orbax_quantization(path) if kind == "orbax" else None
    if saved and quantization and saved != quantization:
        raise CheckpointError(
            f"{path!r} is saved with quantization={saved!r}; it cannot load as "
            f"quantization={quantization!r} (convert the float source instead)"
        )
    quantization = quantization or saved
    _check_act_order(path, quantization, scheme is not None or saved == quantization)
    if scheme is not None:
        handle = PackedView(handle, scheme)
    quantization = _gguf_format(path, kind, handle, quantization)
    family = family_of(cfg)
    float_specs = family.param_specs(cfg, jdtype)
    specs = family.param_specs(cfg, jdtype, quantization)
    restored_specs = family.param_specs(cfg, jdtype, saved)  # orbax: what the checkpoint holds
    if mesh is None:
        mesh = shd.make_mesh(None)

    stages = dict(mesh.shape).get(shd.PIPELINE, 1)
    rules = shd.model_rules(cfg, shd.Parallel.from_mesh(mesh))
    quant.check_group_splits(specs, mesh, rules)

    if kind == "orbax":
        from checkpoints.orbax_io import restore_params
    if kind == "orbax" and stages > 1:  # each layer restored onto its own stage's devices
        params = restore_params(path, pipeline.canonical_targets(restored_specs, mesh, rules))
    elif kind == "orbax":
        params = restore_params(path, params_lib.abstract(restored_specs, mesh, rules))
    if kind == "orbax" and quantization != saved:  # a float checkpoint, quantized where it lies
        params = quant.quantize_params(params, float_specs, quantization)
    if kind != "orbax":

        def put(x, spec):
            if stages > 1:  # NOTE: host arrays; `to_stacked` sends each device only its slices
                return x
            # NOTE: not jax.device_put: with several processes it all-gathers every weight to
            # check that the processes agree; here each process slices its own copy.
            return shd.device_put_global(x, shd.named_sharding(mesh, spec.logical_axes, rules))

        try:
            params = family.params_from_hf(
                cfg,
                handle.tensor_names(),
                handle.tensor,
                jdtype,
                put,
                quantization,
                get_quantized=getattr(handle, "quantized", None),
            )
        except CheckpointError:
            raise
        except ValueError as e:  # missing, unexpected or mis-shaped tensors: name the checkpoint
            raise CheckpointError(f"{path!r}: {e}") from e
        finally:
            if kind == "hf":
                handle.close()
    if stages > 1:  # the canonical layout -> layers stacked by pipeline stage
        params = pipeline.to_stacked(params, specs, mesh, delete_sources=True, rules=rules)
    name = os.path.basename(os.path.normpath(path))
    return LoadedModel(
        name=name,
        path=path,
        source=kind,
        cfg=cfg,
        hf_config=hf_config,
        params=params,
        tokenizer=tokenizer,
        dtype=dtype,
        quantization=quantization,
    )
