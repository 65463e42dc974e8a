"""Hugging Face model directories: `config.json` plus safetensors weights.

Flow:
1. `load_hf_config(path)` reads `config.json` into a dict (the architecture numbers are turned
   into a `ModelConfig` elsewhere; this module does not interpret them).
2. `HFCheckpoint(path)` picks the weight files, in the order `transformers` does:
   `model.safetensors`; else `model.safetensors.index.json`, whose `weight_map` names the shard
   holding each tensor; else every `*.safetensors` in the directory (e.g. Mistral's
   `consolidated.safetensors`). A directory with only PyTorch pickles (`pytorch_model.bin`) or no
   weights at all is rejected.
3. Every file's header is parsed and checked up front (8-byte little-endian header length, JSON,
   each tensor's `data_offsets` inside the file and consistent with its dtype and shape), so a
   corrupted or truncated download fails when the checkpoint is opened, naming the file, and not
   halfway through a load. For a sharded checkpoint every shard the index names must exist and
   hold every tensor the index promises.
4. `tensor(name)` opens the tensor's file lazily with `safetensors.safe_open(framework="numpy")`
   (memory-mapped; one cached handle per file) and returns the array in its stored dtype. Nothing
   is upcast here: bf16 comes back as `ml_dtypes.bfloat16` and fp8 as the matching `ml_dtypes`
   float8 type (read with `np.memmap`, since safetensors' numpy backend cannot name fp8 dtypes).
   Casting is the model loader's decision.
5. `tensors()` yields every tensor in storage order (file by file, by data offset), so a full load
   reads each file front to back.

NOTE: importing `ml_dtypes` registers `bfloat16` with numpy. Without it safetensors fails on
bf16 tensors with "data type 'bfloat16' not understood"; this module imports it for that reason.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
from safetensors import safe_open

from checkpoints.errors import CheckpointError

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_LENGTH_BYTES = 8
# safetensors itself refuses headers above 100 MB; a larger length is a corrupted length field.
_MAX_HEADER_BYTES = 100 * 1024 * 1024
_METADATA_KEY = "__metadata__"
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")

# Bytes per element for the safetensors dtype names; used to check data_offsets against shapes.
_DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "U16": 2,
    "I16": 2,
    "F16": 2,
    "BF16": 2,
    "U32": 4,
    "I32": 4,
    "F32": 4,
    "U64": 8,
    "I64": 8,
    "F64": 8,
    "C64": 8,
}

# dtypes safetensors' numpy backend cannot build (it looks for them on the numpy module).
_MEMMAP_DTYPES = {
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
}


@dataclasses.dataclass(frozen=True)
class _TensorEntry:
    """Where one tensor lives: its file, stored dtype name, shape and byte range."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int  # byte offset of the tensor from the start of the file
    end: int


def load_hf_config(path: str | os.PathLike) -> dict[str, Any]:
    """Reads the `config.json` of a Hugging Face model directory.

    Args:
      path: the model directory, or the `config.json` file itself.

    Returns:
      The parsed JSON object.
    """
    path = Path(path)
    config_file = path if path.is_file() else path / CONFIG_FILE
    if not config_file.is_file():
        raise CheckpointError(f"HF config {config_file} does not exist")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"HF config {config_file} is not valid JSON: {e}") from e
    if not isinstance(config, dict):
        raise CheckpointError(
            f"HF config {config_file} must hold a JSON object, got {type(config).__name__}"
        )
    return config


def _read_header(file: Path) -> dict[str, _TensorEntry]:
    """Parses and checks one safetensors header; returns its tensors in storage order."""
    size = file.stat().st_size
    if size < _LENGTH_BYTES:
        raise CheckpointError(
            f"safetensors file {file} is {size} bytes, too short for the 8-byte header length"
        )
    with open(file, "rb") as f:
        header_len = int.from_bytes(f.read(_LENGTH_BYTES), "little")
        if header_len == 0 or header_len > _MAX_HEADER_BYTES:
            raise CheckpointError(
                f"safetensors file {file} has a corrupted header length field ({header_len})"
            )
        if _LENGTH_BYTES + header_len > size:
            raise CheckpointError(
                f"safetensors file {file} is truncated: its header is {header_len} bytes but the "
                f"file is only {size} bytes"
            )
        raw = f.read(header_len)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"safetensors file {file} has a corrupted header: {e}") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"safetensors file {file} has a corrupted header: not a JSON object")

    data_start = _LENGTH_BYTES + header_len
    data_len = size - data_start
    entries = {}
    for name, info in header.items():
        if name == _METADATA_KEY:
            continue
        try:
            dtype = info["dtype"]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(o) for o in info["data_offsets"])
        except (TypeError, KeyError, ValueError) as e:
            raise CheckpointError(
                f"safetensors file {file} has a malformed header entry for tensor {name!r}: {info!r}"
            ) from e
        if not isinstance(dtype, str) or any(d < 0 for d in shape) or not 0 <= begin <= end:
            raise CheckpointError(
                f"safetensors file {file} has a malformed header entry for tensor {name!r}: {info!r}"
            )
        if end > data_len:
            raise CheckpointError(
                f"safetensors file {file} is truncated: tensor {name!r} ends at data offset {end} "
                f"but the file holds only {data_len} data bytes"
            )
        itemsize = _DTYPE_BYTES.get(dtype)
        if itemsize is not None and (end - begin) != itemsize * int(np.prod(shape)):
            raise CheckpointError(
                f"safetensors file {file} is corrupted: tensor {name!r} ({dtype}{list(shape)}) "
                f"spans {end - begin} bytes, expected {itemsize * int(np.prod(shape))}"
            )
        entries[name] = _TensorEntry(file, dtype, shape, data_start + begin, data_start + end)
    return dict(sorted(entries.items(), key=lambda kv: kv[1].begin))


def _read_index(root: Path) -> dict[str, _TensorEntry]:
    """Resolves a sharded checkpoint's weight_map against the shards' own headers."""
    index_file = root / INDEX_FILE
    try:
        index = json.loads(index_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"safetensors index {index_file} is not valid JSON: {e}") from e
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(
            f"safetensors index {index_file} has no 'weight_map' object mapping tensors to shards"
        )

    by_shard: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        if not isinstance(shard, str):
            raise CheckpointError(
                f"safetensors index {index_file} maps tensor {name!r} to {shard!r}, not a file name"
            )
        by_shard.setdefault(shard, []).append(name)

    entries = {}
    for shard in sorted(by_shard):
        shard_file = root / shard
        if not shard_file.is_file():
            raise CheckpointError(
                f"safetensors index {index_file} names shard {shard_file} (for tensor "
                f"{by_shard[shard][0]!r}), which does not exist"
            )
        header = _read_header(shard_file)
        for name in by_shard[shard]:
            if name not in header:
                raise CheckpointError(
                    f"safetensors index {index_file} promises tensor {name!r} in shard "
                    f"{shard_file}, but that shard does not hold it"
                )
        entries.update((name, entry) for name, entry in header.items() if name in weight_map)
    return entries


def _find_tensors(root: Path) -> dict[str, _TensorEntry]:
    """Picks the weight files of a model directory and indexes every tensor in them."""
    if (root / SINGLE_FILE).is_file():
        return _read_header(root / SINGLE_FILE)
    if (root / INDEX_FILE).is_file():
        return _read_index(root)
    files = sorted(root.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in root.iterdir() if p.suffix in _PICKLE_SUFFIXES)
        found = (
            f"; found only PyTorch weights {pickles}, convert them to safetensors"
            if pickles
            else ""
        )
        raise CheckpointError(f"no safetensors weights in {root}{found}")
    entries: dict[str, _TensorEntry] = {}
    for file in files:
        for name, entry in _read_header(file).items():
            if name in entries:
                raise CheckpointError(
                    f"tensor {name!r} appears in both {entries[name].file} and {file} "
                    f"and {root} has no {INDEX_FILE} to say which is meant"
                )
            entries[name] = entry
    return entries


class HFCheckpoint:
    """A Hugging Face model directory: its config and lazily read safetensors tensors.

    Every weight file's header is validated when the checkpoint is opened (see the module
    docstring); tensor data is read only when asked for. Use as a context manager, or call
    `close()`, to release the memory-mapped files early.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"HF checkpoint directory {self.path} does not exist")
        self.config: dict[str, Any] = load_hf_config(self.path)
        self._entries = _find_tensors(self.path)
        self._handles: dict[Path, Any] = {}

    def tensor_names(self) -> list[str]:
        """Every tensor name, in storage order (file by file, by data offset)."""
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def tensor(self, name: str) -> np.ndarray:
        """Reads one tensor in its stored dtype (bf16 as `ml_dtypes.bfloat16`, never upcast)."""
        entry = self._entries.get(name)
        if entry is None:
            close = difflib.get_close_matches(name, self._entries, n=3)
            hint = f"; close names: {close}" if close else ""
            raise CheckpointError(f"tensor {name!r} is not in HF checkpoint {self.path}{hint}")
        if entry.dtype in _MEMMAP_DTYPES:
            return np.memmap(
                entry.file,
                dtype=_MEMMAP_DTYPES[entry.dtype],
                mode="r",
                offset=entry.begin,
                shape=entry.shape,
            )
        try:
            handle = self._handles.get(entry.file)
            if handle is None:
                handle = self._handles[entry.file] = safe_open(str(entry.file), framework="numpy")
            return handle.get_tensor(name)
        except Exception as e:  # SafetensorError, or numpy rejecting an exotic dtype
            raise CheckpointError(
                f"cannot read tensor {name!r} ({entry.dtype}{list(entry.shape)}) from {entry.file}: {e}"
            ) from e

    def tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        """Yields `(name, array)` for every tensor, in storage order."""
        for name in self._entries:
            yield name, self.tensor(name)

    def close(self) -> None:
        """Releases the memory-mapped files; arrays already returned stay valid."""
        for handle in self._handles.values():
            handle.__exit__(None, None, None)
        self._handles.clear()

    def __enter__(self) -> HFCheckpoint:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
