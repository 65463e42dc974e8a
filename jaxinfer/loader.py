"""Load a model from any supported source into a params tree on devices.

1. `resolve_model_path(None)` is the embedded default (SmolLM2-135M-Instruct, Q4_1 GGUF).
2. `open_source(path)` recognises the source: a GGUF file, an orbax checkpoint dir written by
   `scripts/convert.py`, or a Hugging Face dir (`config.json` + `*.safetensors`); anything else
   raises naming the path.
3. `load_model` builds the `ModelConfig` from the source's HF-style config, then fills the params
   tree tensor by tensor (HF and GGUF sources) or restores it from orbax straight into the target
   shardings, and builds the tokenizer from the same source.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax

from checkpoints.errors import CheckpointError
from checkpoints.gguf import read_gguf
from checkpoints.hf import HFCheckpoint, load_hf_config
from checkpoints.orbax_io import is_orbax_checkpoint, restore_params
from jaxinfer import params as params_lib
from jaxinfer import sharding as shd
from jaxinfer.config import ModelConfig
from jaxinfer.default_model import default_model_path
from jaxinfer.models import llama
from jaxinfer.tokenizer import Tokenizer

GGUF_TOKENIZER_FILE = "gguf_tokenizer.json"  # tokenizer.* metadata of a converted GGUF model


@dataclasses.dataclass
class LoadedModel:
    name: str
    path: str
    source: str  # "gguf" | "hf" | "orbax"
    cfg: ModelConfig
    hf_config: dict[str, Any]
    params: Any
    tokenizer: Tokenizer
    dtype: str


def resolve_model_path(model: str | os.PathLike | None) -> str:
    if model is None:
        return default_model_path()
    path = os.fspath(model)
    if not os.path.exists(path):
        raise FileNotFoundError(f"model path {path!r} does not exist (expected a GGUF file, a "
                                f"Hugging Face model directory or a jaxinfer orbax checkpoint dir)")
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
    if is_orbax_checkpoint(path):
        return "orbax", path
    if os.path.isfile(os.path.join(path, "config.json")):
        return "hf", HFCheckpoint(path)
    raise CheckpointError(
        f"{path!r} holds no model: expected config.json + *.safetensors, or an orbax checkpoint "
        f"written by scripts/convert.py")


def load_tokenizer(kind: str, handle: Any, path: str) -> Tokenizer:
    if kind == "gguf":
        return Tokenizer.from_gguf_metadata(handle.metadata)
    gguf_tok = os.path.join(path, GGUF_TOKENIZER_FILE)
    if os.path.isfile(gguf_tok):
        with open(gguf_tok) as f:
            return Tokenizer.from_gguf_metadata(json.load(f))
    return Tokenizer.from_path(path)


def load_model(model: str | os.PathLike | None = None, *, dtype: str | None = None,
               mesh: jax.sharding.Mesh | None = None) -> LoadedModel:
    path = resolve_model_path(model)
    dtype = dtype or default_dtype()
    if dtype not in params_lib.DTYPES:
        raise ValueError(f"dtype must be one of {sorted(params_lib.DTYPES)}, got {dtype!r}")
    jdtype = params_lib.DTYPES[dtype]
    kind, handle = open_source(path)
    if kind == "orbax":
        hf_config = load_hf_config(path)
    else:
        hf_config = handle.hf_config() if kind == "gguf" else handle.config
    cfg = ModelConfig.from_hf(hf_config)
    specs = llama.param_specs(cfg, jdtype)
    if mesh is None:
        mesh = shd.make_mesh(None)

    if kind == "orbax":
        params = restore_params(path, params_lib.abstract(specs, mesh))
    else:
        def put(x, spec):
            return jax.device_put(x, shd.named_sharding(mesh, spec.logical_axes))

        params = llama.params_from_hf(cfg, handle.tensor_names(), handle.tensor, jdtype, put)
    tokenizer = load_tokenizer(kind, handle, path)
    name = os.path.basename(os.path.normpath(path))
    return LoadedModel(name=name, path=path, source=kind, cfg=cfg, hf_config=hf_config,
                       params=params, tokenizer=tokenizer, dtype=dtype)

