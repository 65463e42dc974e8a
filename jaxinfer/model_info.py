"""A model's source, config and tokenizer without its weights (no JAX imported: the serving front
end reads the model with it while the engine-core process loads the weights).

1. `resolve_model_path(None)` is the embedded default (SmolLM2-135M-Instruct, Q4_1 GGUF).
2. `open_source(path)` recognises the source: a GGUF file, an orbax checkpoint dir written by
   `scripts/convert.py`, or a Hugging Face dir (`config.json` + `*.safetensors`); anything else
   raises naming the path. A HF dir's config is checked before any weight file is opened, so an
   unsupported architecture is reported as such.
3. `source_hf_config` and `load_tokenizer` read an opened source's HF-style config and tokenizer
   (a converted GGUF model's tokenizer from its `GGUF_TOKENIZER_FILE`); `dummy_source` reads them
   for `load_format="dummy"` (a directory without tokenizer files gets a placeholder vocabulary).
4. `load_model_info` returns them as a `LoadedModel` whose `params` is None; `jaxinfer.loader`
   fills the same record with the weights on a mesh.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any

from checkpoints.errors import CheckpointError
from checkpoints.gguf import read_gguf
from checkpoints.hf import HFCheckpoint, load_hf_config
from checkpoints.orbax_layout import PARAMS_DIR, is_orbax_checkpoint
from jaxinfer.config import ModelConfig
from jaxinfer.default_model import default_model_path
from jaxinfer.tokenizer import Tokenizer

GGUF_TOKENIZER_FILE = "gguf_tokenizer.json"  # tokenizer.* metadata of a converted GGUF model
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", GGUF_TOKENIZER_FILE)
LOAD_FORMATS = ("auto", "dummy")  # "auto": the source's weights; "dummy": random weights
log = logging.getLogger(__name__)


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
    params: Any  # None from `load_model_info`
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


def dummy_source(
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
        hf_config, tokenizer = dummy_source(path, skip_tokenizer_init)
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
