"""Convert a Hugging Face dir or a GGUF file into a jaxinfer orbax checkpoint dir.

Layout written to `dst`, which `jaxinfer.loader.load_model(dst)` and `LLM(dst)` read back:

    dst/params/               the params tree (`checkpoints.orbax_io.save_params`)
    dst/config.json           the HF-style config the model was built from (`LoadedModel.hf_config`)
    dst/tokenizer.json, ...   HF sources: the tokenizer files the source dir has (`TOKENIZER_FILES`)
    dst/gguf_tokenizer.json   GGUF sources: the `tokenizer.*` metadata plus `general.architecture`
    dst/jaxinfer.json         {"source": absolute path, "source_kind": "hf" | "gguf", "dtype": ...,
                               "quantization": the format that loaded: None | "int8[-g<n>][-act]"
                               | "fp8"}

Flow:
1. `dst` must be missing or an empty directory; a non-empty one is replaced only with
   `force=True`, and never when it is the source itself.
2. The source is opened with `jaxinfer.model_info.open_source` and loaded with `load_from_source` on
   one device, in `dtype` (float32 by default: lossless for every source we read, since GGUF
   tensors are dequantized to f32 and HF f16/bf16/fp8 widen exactly; `load_model` casts floats to
   the runtime dtype while restoring). The tokenizer is built as part of the load, so a source
   whose tokenizer does not load is refused before anything is written.
3. Everything is written into a fresh hidden directory beside `dst` and then moved into place, so
   `dst` never holds a half-written checkpoint. With `force`, only the entries a conversion writes
   (`OUTPUT_NAMES`) are replaced in an existing `dst`; other files there are left alone.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

from checkpoints.errors import CheckpointError
from checkpoints.orbax_io import save_params
from checkpoints.orbax_layout import PARAMS_DIR
from checkpoints.quantize import FLOAT
from checkpoints.quantize import check_format as check_quantization
from jaxinfer import params as params_lib
from jaxinfer import sharding as shd
from jaxinfer.loader import load_from_source
from jaxinfer.model_info import GGUF_TOKENIZER_FILE, open_source, resolve_model_path

CONFIG_FILE = "config.json"
INFO_FILE = "jaxinfer.json"
DEFAULT_DTYPE = "float32"
# Files `jaxinfer.tokenizer.Tokenizer.from_path` reads from a model directory.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
)
# Every entry a conversion may write into `dst` (what `force` replaces).
OUTPUT_NAMES = (PARAMS_DIR, CONFIG_FILE, INFO_FILE, GGUF_TOKENIZER_FILE, *TOKENIZER_FILES)

logger = logging.getLogger(__name__)


def _check_destination(dst: Path, src: str, force: bool) -> None:
    if dst.exists() and not dst.is_dir():
        raise FileExistsError(f"destination {str(dst)!r} exists and is not a directory")
    if dst.is_dir() and os.path.samefile(dst, src):
        raise FileExistsError(f"destination {str(dst)!r} is the source itself; pick another dir")
    if dst.is_dir() and any(dst.iterdir()) and not force:
        raise FileExistsError(
            f"destination {str(dst)!r} is not empty; pass force=True (--force) to replace the "
            f"checkpoint in it"
        )


def _gguf_tokenizer_metadata(metadata: dict[str, Any]) -> dict[str, Any]:
    """The keys `Tokenizer.from_gguf_metadata` reads, plus the architecture for reference."""
    keys = [k for k in metadata if k.startswith("tokenizer.")]
    if not keys:
        raise CheckpointError("GGUF metadata has no tokenizer.* keys to write")
    return {
        "general.architecture": metadata.get("general.architecture"),
        **{k: metadata[k] for k in keys},
    }


def _write_checkpoint(
    out: Path, src_path: str, kind: str, handle: Any, dtype: str, quantization: str | None
) -> None:
    # NOTE: a GGUF file loads in its own bits by default (int4 among them), which orbax cannot
    # store: without `quantization` its blocks are dequantized (step 2)
    asked = quantization or (FLOAT if kind == "gguf" else None)
    model = load_from_source(
        src_path, kind, handle, dtype=dtype, mesh=shd.make_mesh(None), quantization=asked
    )
    if model.quantization and model.quantization.startswith("int4"):
        raise ValueError(
            f"{src_path!r} loads as {model.quantization} (a 4-bit checkpoint in its own bits), "
            "which orbax cannot store (tensorstore has no 4-bit type): serve the source itself"
        )
    info = {
        "source": os.path.abspath(src_path),
        "source_kind": kind,
        "dtype": dtype,
        "quantization": model.quantization,
    }
    extra: dict[str, str] = {
        CONFIG_FILE: json.dumps(model.hf_config, indent=2) + "\n",
        INFO_FILE: json.dumps(info, indent=2) + "\n",
    }
    if kind == "gguf":
        # NOTE: ensure_ascii (the default) keeps the surrogate escapes that non-UTF-8 GGUF
        # tokens decode to; json.load gives the same str back.
        extra[GGUF_TOKENIZER_FILE] = json.dumps(_gguf_tokenizer_metadata(handle.metadata))
    save_params(out, model.params, extra_files=extra)
    if kind == "hf":
        for name in TOKENIZER_FILES:
            if os.path.isfile(os.path.join(src_path, name)):
                shutil.copyfile(os.path.join(src_path, name), out / name)


def _move_into_place(tmp: Path, dst: Path) -> None:
    if not dst.exists() or not any(dst.iterdir()):
        os.replace(tmp, dst)  # an empty dst directory is replaced whole (POSIX rename)
        return
    for name in OUTPUT_NAMES:
        old = dst / name
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old)
        elif old.exists() or old.is_symlink():
            old.unlink()
    for entry in tmp.iterdir():
        os.replace(entry, dst / entry.name)
    tmp.rmdir()


def convert(
    src: str | os.PathLike | None,
    dst: str | os.PathLike,
    dtype: str | None = None,
    *,
    force: bool = False,
    quantization: str | None = None,
) -> str:
    """Converts a HF dir or a GGUF file into an orbax checkpoint dir that `load_model` loads.

    Args:
      src: a Hugging Face model dir (config.json + safetensors + tokenizer files) or a GGUF
        file; None is the embedded default model.
      dst: the checkpoint dir to write; must be missing or empty unless `force`.
      dtype: "float32" (default) or "bfloat16", the dtype the params are stored in.
      force: replace the checkpoint entries of a non-empty `dst` (other files stay).
      quantization: None, "int8" or "fp8": store the quantizable weights quantized (see
        `jaxinfer.quantization`); `load_model(dst)` then loads them in that format.

    Returns:
      The absolute path of `dst`.
    """
    check_quantization(quantization)
    if quantization and quantization.startswith("int4"):
        # NOTE: tensorstore (orbax's storage) has no 4-bit dtype; load the source with int4 instead.
        raise ValueError(
            f"quantization={quantization!r}: int4 checkpoints cannot be saved to orbax yet "
            "(tensorstore has no 4-bit type); load the source with quantization='int4' instead"
        )
    src_path = resolve_model_path(src)
    dtype = dtype or DEFAULT_DTYPE
    if dtype not in params_lib.DTYPES:
        raise ValueError(f"dtype must be one of {sorted(params_lib.DTYPES)}, got {dtype!r}")
    dst = Path(dst).absolute()
    _check_destination(dst, src_path, force)
    kind, handle = open_source(src_path)
    if kind == "orbax":
        raise CheckpointError(f"{src_path!r} is already a jaxinfer orbax checkpoint")

    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.parent / f".{dst.name}.converting-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        logger.info("converting %s (%s) to %s in %s", src_path, kind, dst, dtype)
        _write_checkpoint(tmp, src_path, kind, handle, dtype, quantization)
        _move_into_place(tmp, dst)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return str(dst)
