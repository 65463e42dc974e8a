"""Load a model from any supported source into a params tree on devices.

1. `resolve_model_path(None)` is the embedded default (SmolLM2-135M-Instruct, Q4_1 GGUF).
2. `open_source(path)` recognises the source: a GGUF file, an orbax checkpoint dir written by
   `scripts/convert.py`, or a Hugging Face dir (`config.json` + `*.safetensors`); anything else
   raises naming the path. A HF dir's config is checked before any weight file is opened, so an
   unsupported architecture is reported as such.
3. `load_from_source` (what `load_model` calls after step 2; `jaxinfer.convert` calls it with
   the handle it already holds) builds the `ModelConfig` from the source's HF-style config and the
   tokenizer (before any weight is read, so a missing tokenizer fails fast; none at all with
   `skip_tokenizer_init`), then fills the params
   tree tensor by tensor (HF and GGUF sources) or restores it from orbax straight into the target
   shardings. With `quantization` ("int8" | "fp8") HF and GGUF tensors are quantized on the host
   as they are read (GGUF block formats requantized row chunk by row chunk, no float32 copy), a
   float orbax checkpoint is quantized on device after its restore, and a quantized orbax
   checkpoint restores as it is. On a pipeline mesh the params come back stacked by stage (`jaxinfer.pipeline`):
   orbax restores each layer onto its stage's devices, HF/GGUF tensors are read to the host and
   each device receives only its slices.
4. `load_format="dummy"` (vLLM's name) reads only the source's config (a `config.json`, or a GGUF
   file's metadata) and tokenizer (`Tokenizer.placeholder` when the directory has none), and
   fills the params tree with random weights of the declared shapes and dtype (int8 / fp8 leaves
   with `quantization=`)
   (`params.init_on_device`: jitted programs, sharded on the mesh, nothing on the host); the init
   scale (std 0.02, unit norms) keeps logits finite. For benchmarking any architecture without
   its weights.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any

import jax

from checkpoints.errors import CheckpointError
from checkpoints.gguf import read_gguf
from checkpoints.hf import HFCheckpoint, load_hf_config
from checkpoints.orbax_io import PARAMS_DIR, is_orbax_checkpoint, restore_params, saved_leaves
from jaxinfer import params as params_lib
from jaxinfer import pipeline
from jaxinfer import quantization as quant
from jaxinfer import sharding as shd
from jaxinfer.config import ModelConfig
from jaxinfer.default_model import default_model_path
from jaxinfer.models import family_of
from jaxinfer.tokenizer import Tokenizer

GGUF_TOKENIZER_FILE = "gguf_tokenizer.json"  # tokenizer.* metadata of a converted GGUF model
log = logging.getLogger(__name__)
LOAD_FORMATS = ("auto", "dummy")  # "auto": the source's weights; "dummy": random weights
DUMMY_SEED = 0


def check_load_format(load_format: str) -> None:
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format {load_format!r} is not one of {LOAD_FORMATS}")


@dataclasses.dataclass
class LoadedModel:
    name: str
    path: str
    source: str  # "gguf" | "hf" | "orbax" | "dummy"
    cfg: ModelConfig
    hf_config: dict[str, Any]
    params: Any
    tokenizer: Tokenizer | None  # None when loaded with skip_tokenizer_init
    dtype: str
    quantization: str | None = None  # "int8" | "fp8": weight-only, see jaxinfer.quantization

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The tokenizer's end-of-sequence ids; without a tokenizer, the config's `eos_token_id`."""
        if self.tokenizer is not None:
            return tuple(self.tokenizer.eos_token_ids)
        eos = (self.hf_config or {}).get("eos_token_id")
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        return tuple(int(e) for e in eos)


def resolve_model_path(model: str | os.PathLike | None) -> str:
    if model is None:
        return default_model_path()
    path = os.fspath(model)
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"model path {path!r} does not exist (expected a GGUF file, a "
            f"Hugging Face model directory or a jaxinfer orbax checkpoint dir)"
        )
    return path


def default_dtype() -> str:
    """f32 on CPU (XLA:CPU multiplies bf16 matrices by vectors >10x slower), bf16 on accelerators."""
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def open_source(path: str) -> tuple[str, Any]:
    """Returns (kind, handle): ("gguf", GGUFCheckpoint) | ("orbax", dir) | ("hf", HFCheckpoint)."""
    if os.path.isfile(path):
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic == b"GGUF" or path.endswith(".gguf"):
            return "gguf", read_gguf(path)
        raise CheckpointError(f"{path!r} is a file but not a GGUF model (no GGUF magic)")
    if not os.path.isdir(path):
        raise CheckpointError(f"{path!r} is neither a file nor a directory")
    if is_orbax_checkpoint(path):
        return "orbax", path
    has_safetensors = any(name.endswith(".safetensors") for name in os.listdir(path))
    params_dir = os.path.join(path, PARAMS_DIR)
    if os.path.isdir(params_dir) and not has_safetensors:
        raise CheckpointError(
            f"{params_dir!r} is not a finished orbax checkpoint (no _CHECKPOINT_METADATA / "
            f"_METADATA): its conversion was interrupted; run scripts/convert.py again"
        )
    if os.path.isfile(os.path.join(path, "config.json")):
        ModelConfig.from_hf(load_hf_config(path))
        return "hf", HFCheckpoint(path)
    raise CheckpointError(
        f"{path!r} holds no model: expected config.json + *.safetensors, or an orbax checkpoint "
        f"written by scripts/convert.py"
    )


def load_tokenizer(kind: str, handle: Any, path: str) -> Tokenizer:
    if kind == "gguf":
        return Tokenizer.from_gguf_metadata(handle.metadata, source=path)
    gguf_tok = os.path.join(path, GGUF_TOKENIZER_FILE)
    if os.path.isfile(gguf_tok):
        try:
            with open(gguf_tok, encoding="utf-8") as f:
                metadata = json.load(f)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"cannot read GGUF tokenizer metadata {gguf_tok!r}: {e}") from e
        if not isinstance(metadata, dict):
            raise CheckpointError(f"{gguf_tok!r} must hold a JSON object of tokenizer.* keys")
        return Tokenizer.from_gguf_metadata(metadata, source=gguf_tok)
    return Tokenizer.from_path(path)


def source_hf_config(path: str, kind: str, handle: Any) -> dict[str, Any]:
    """The HF-style config of an opened source."""
    if kind == "orbax":
        return load_hf_config(path)
    return handle.hf_config() if kind == "gguf" else handle.config


def load_model_info(
    model: str | os.PathLike | None = None,
    *,
    load_format: str = "auto",
    skip_tokenizer_init: bool = False,
) -> LoadedModel:
    """Config and tokenizer of a model without its weights (`params` None; no device touched):
    what a serving front end needs while the engine-core process loads the weights (no
    tokenizer with `skip_tokenizer_init`)."""
    check_load_format(load_format)
    path = resolve_model_path(model)
    name = os.path.basename(os.path.normpath(path))
    if load_format == "dummy":
        hf_config, tokenizer = _dummy_source(path, skip_tokenizer_init)
        return LoadedModel(
            name=name,
            path=path,
            source="dummy",
            cfg=ModelConfig.from_hf(hf_config),
            hf_config=hf_config,
            params=None,
            tokenizer=tokenizer,
            dtype="",
        )
    kind, handle = open_source(path)
    try:
        hf_config = source_hf_config(path, kind, handle)
        cfg = ModelConfig.from_hf(hf_config)
        tokenizer = None if skip_tokenizer_init else load_tokenizer(kind, handle, path)
    finally:
        if kind == "hf":
            handle.close()
    return LoadedModel(
        name=name,
        path=path,
        source=kind,
        cfg=cfg,
        hf_config=hf_config,
        params=None,
        tokenizer=tokenizer,
        dtype="",
    )


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
      quantization: None, "int8" or "fp8": store the linear weights and the embedding quantized
        (weight-only, one scale per output channel), quantized on the host as they are read
        (GGUF blocks requantized without a float32 copy of the tensor). An orbax checkpoint
        saved quantized loads in its own format when this is None. With `load_format="dummy"`
        the random weights are created quantized.
      load_format: "auto" reads the source's weights; "dummy" creates random weights of the same
        shapes, dtype and shardings on the devices (step 4 of the module docstring).
      skip_tokenizer_init: load no tokenizer (vLLM's name): token ids in and out, so a checkpoint
        without tokenizer files loads; `tokenizer` is then None.

    Returns:
      The config, params (on `mesh`) and tokenizer.
    """
    quant.check_quantization(quantization)  # a bad value fails before anything is read
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
    """The format an orbax checkpoint was saved in: None (float) or "int8" / "fp8". A quantized
    one whose scales lack the contraction axis (converted before group-wise scales) is refused."""
    leaves = saved_leaves(path)
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
    return fmt


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", GGUF_TOKENIZER_FILE)


def _dummy_source(
    path: str, skip_tokenizer_init: bool = False
) -> tuple[dict[str, Any], Tokenizer | None]:
    """(HF-style config, tokenizer) of a GGUF file (its metadata only) or a model directory; a
    directory without tokenizer files gets `Tokenizer.placeholder` (ids render as `<id>`), and
    `skip_tokenizer_init` none at all."""
    if os.path.isfile(path):
        kind, handle = open_source(path)  # a file is a GGUF or an error naming it
        return handle.hf_config(), None if skip_tokenizer_init else load_tokenizer(
            kind, handle, path
        )
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise CheckpointError(
            f"load_format='dummy' needs a config.json in {path!r} (or a GGUF file)"
        )
    hf_config = load_hf_config(path)
    if skip_tokenizer_init:
        return hf_config, None
    if any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        return hf_config, load_tokenizer("hf", None, path)
    log.warning("%r has no tokenizer files: token ids render as '<id>' (load_format='dummy')", path)
    vocab = ModelConfig.from_hf(hf_config).vocab_size
    eos = hf_config.get("eos_token_id")
    eos_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    return hf_config, Tokenizer.placeholder(
        vocab,
        bos_token_id=hf_config.get("bos_token_id"),
        eos_token_ids=[i for i in eos_ids if 0 <= i < vocab],
        source=f"placeholder vocabulary of {path}",
    )


def load_dummy(
    path: str,
    *,
    dtype: str | None = None,
    mesh: jax.sharding.Mesh | None = None,
    quantization: str | None = None,
    skip_tokenizer_init: bool = False,
) -> LoadedModel:
    """Step 4 of the module docstring: the source's config and tokenizer, random weights (stored
    quantized when `quantization` is given)."""
    quant.check_quantization(quantization)
    dtype = _resolve_dtype(dtype)
    hf_config, tokenizer = _dummy_source(path, skip_tokenizer_init)
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
    quant.check_quantization(quantization)
    dtype = _resolve_dtype(dtype)
    jdtype = params_lib.DTYPES[dtype]
    hf_config = source_hf_config(path, kind, handle)
    cfg = ModelConfig.from_hf(hf_config)
    tokenizer = None if skip_tokenizer_init else load_tokenizer(kind, handle, path)
    saved = orbax_quantization(path) if kind == "orbax" else None
    if saved and quantization and saved != quantization:
        raise CheckpointError(
            f"{path!r} is saved with quantization={saved!r}; it cannot load as "
            f"quantization={quantization!r} (convert the float source instead)"
        )
    quantization = quantization or saved
    family = family_of(cfg)
    float_specs = family.param_specs(cfg, jdtype)
    specs = family.param_specs(cfg, jdtype, quantization)
    restored_specs = family.param_specs(cfg, jdtype, saved)  # orbax: what the checkpoint holds
    if mesh is None:
        mesh = shd.make_mesh(None)

    stages = dict(mesh.shape).get(shd.PIPELINE, 1)
    rules = shd.model_rules(cfg, shd.Parallel.from_mesh(mesh))
    quant.check_group_splits(specs, mesh, rules)

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
                get_quantized=handle.quantized if kind == "gguf" else None,
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
