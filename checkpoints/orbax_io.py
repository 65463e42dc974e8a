"""Orbax save/restore of a params pytree, restoring straight into sharded arrays.

Layout written by `save_params(path, ...)`:

    path/params/        an Orbax `StandardCheckpointer` checkpoint (OCDBT + tensorstore); where it
                        lies and how a finished one is told: `orbax_layout` (no JAX)
    path/config.json    any `extra_files` (config, tokenizer files), written verbatim beside it

Flow:
1. `save_params` checks every leaf is an array (naming the first that is not), then saves with
   `orbax.checkpoint.StandardCheckpointer` (the current, non-deprecated API in orbax-checkpoint
   0.12.8; `PyTreeCheckpointer` is its legacy spelling) and blocks until the checkpoint is
   committed. Orbax writes to a temporary directory and renames it, so `path/params` either is a
   whole checkpoint or does not exist.
2. `restore_params` turns the target into abstract leaves (`jax.ShapeDtypeStruct` with a
   sharding; a `jax.Array` leaf lends its shape, dtype and sharding; an `np.ndarray` leaf is
   restored as a host numpy array), then compares it with the checkpoint's own metadata, leaf by
   leaf, *before* reading any data: a leaf missing on either side, a shape mismatch or a forbidden
   dtype change raises `CheckpointError` naming the leaf path (e.g. `layers.1.attn.wq`).
   This check is ours because Orbax alone lets some of these through: a target leaf without a
   sharding is silently restored with the checkpoint's shape, whatever shape the target says.
3. Orbax then reads, on each device, only the slices its shards of the target sharding need
   (no full host copy per device) and returns the target's own pytree type (registered
   dataclasses included) with every array on the target sharding.

NOTE: dtype policy. A floating leaf may be restored into a different floating dtype (save f32,
restore bf16): Orbax casts while reading. Any other dtype change (float <-> int, int8 -> int32, to
or from bool) raises `CheckpointError`, since it would silently reinterpret quantized weights.

NOTE: leaf paths are the keys joined with "." (`jax.tree_util.keystr(simple=True)`), which is the
same spelling for a dataclass field, a dict key and Orbax's metadata, so target and checkpoint
line up whichever container types the params use.

NOTE: Orbax logs every save and restore at INFO/DEBUG through absl (tens of lines, including
tensorstore metrics). Importing this module installs a filter on the `absl` logger that drops
records below WARNING coming from Orbax's own source files; Orbax warnings and errors still show.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from checkpoints.errors import CheckpointError
from checkpoints.orbax_layout import ORBAX_MARKERS, PARAMS_DIR, is_orbax_checkpoint

_MAX_LISTED = 8


class _OrbaxChatterFilter(logging.Filter):
    """Drops Orbax's sub-WARNING absl records; keeps everyone else's records untouched."""

    _MARK = f"{os.sep}orbax{os.sep}"

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or self._MARK not in record.pathname


def _install_log_filter() -> None:
    absl_logger = logging.getLogger("absl")
    if not any(isinstance(f, _OrbaxChatterFilter) for f in absl_logger.filters):
        absl_logger.addFilter(_OrbaxChatterFilter())


_install_log_filter()


def _leaf_name(key_path: tuple[Any, ...]) -> str:
    return jax.tree_util.keystr(key_path, simple=True, separator=".") or "<root>"


def _named_leaves(tree: Any) -> list[tuple[str, Any]]:
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [(_leaf_name(path), leaf) for path, leaf in leaves]


def _listing(names: list[str]) -> str:
    more = len(names) - _MAX_LISTED
    return ", ".join(names[:_MAX_LISTED]) + (f" (and {more} more)" if more > 0 else "")


def save_params(
    path: str | os.PathLike,
    params: Any,
    *,
    extra_files: dict[str, bytes | str] | None = None,
    overwrite: bool = False,
) -> None:
    """Saves a params pytree as an Orbax checkpoint under `path/params`, blocking until written.

    Args:
      path: checkpoint directory (created if absent).
      params: pytree (e.g. of registered dataclasses) whose leaves are `jax.Array`s (any
        sharding) or `np.ndarray`s.
      extra_files: file name -> contents (str is written as UTF-8), written into `path` beside
        `params/`, e.g. `config.json` and tokenizer files.
      overwrite: replace an existing `path/params` (and same-named extra files) instead of raising.
    """
    path = Path(path)
    params_dir = path / PARAMS_DIR
    leaves = _named_leaves(params)
    if not leaves:
        raise CheckpointError(f"refusing to save an empty params tree to {params_dir}")
    for name, leaf in leaves:
        if not isinstance(leaf, (jax.Array, np.ndarray)):
            raise CheckpointError(
                f"params leaf {name} is a {type(leaf).__name__}, not a jax.Array or np.ndarray"
            )
    extra_files = dict(extra_files or {})
    for name, contents in extra_files.items():
        if not name or name in (".", "..", PARAMS_DIR) or Path(name).name != name:
            raise CheckpointError(
                f"extra file name {name!r} must be a plain file name other than {PARAMS_DIR!r}"
            )
        if not isinstance(contents, (bytes, str)):
            raise CheckpointError(
                f"extra file {name!r} contents must be bytes or str, got {type(contents).__name__}"
            )
    if params_dir.exists() and not overwrite:
        raise CheckpointError(f"{params_dir} already exists; pass overwrite=True to replace it")

    path.mkdir(parents=True, exist_ok=True)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(params_dir.absolute(), params, force=overwrite)
        checkpointer.wait_until_finished()
    for name, contents in extra_files.items():
        if isinstance(contents, str):
            (path / name).write_text(contents, encoding="utf-8")
        else:
            (path / name).write_bytes(contents)


def _abstract_leaf(name: str, leaf: Any) -> Any:
    """The restore target for one leaf: a sharded ShapeDtypeStruct, or an np.ndarray."""
    if isinstance(leaf, jax.ShapeDtypeStruct):
        if leaf.sharding is None:
            raise CheckpointError(
                f"restore target leaf {name} is a ShapeDtypeStruct without a sharding; "
                "give it the sharding it should be restored into"
            )
        return leaf
    if isinstance(leaf, jax.Array):
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding)
    if isinstance(leaf, np.ndarray):
        return leaf
    raise CheckpointError(
        f"restore target leaf {name} is a {type(leaf).__name__}; expected jax.ShapeDtypeStruct, "
        "jax.Array or np.ndarray"
    )


def _dtype_change_allowed(saved: np.dtype, wanted: np.dtype) -> bool:
    if saved == wanted:
        return True
    # jnp.issubdtype knows the ml_dtypes floats (bf16, fp8); np.issubdtype does not.
    return bool(jnp.issubdtype(saved, jnp.floating) and jnp.issubdtype(wanted, jnp.floating))


def _check_against_metadata(params_dir: Path, target_leaves: list[tuple[str, Any]]) -> None:
    """Raises CheckpointError for any leaf whose presence, shape or dtype does not line up."""
    with ocp.StandardCheckpointer() as checkpointer:
        item_metadata = checkpointer.metadata(params_dir.absolute()).item_metadata
    tree = getattr(item_metadata, "tree", None)
    if tree is None:
        raise CheckpointError(f"checkpoint {params_dir} has no readable pytree metadata")
    saved = dict(_named_leaves(tree))
    wanted = dict(target_leaves)

    missing = [name for name in wanted if name not in saved]
    unexpected = [name for name in saved if name not in wanted]
    problems = []
    if missing:
        problems.append(f"leaves missing from the checkpoint: {_listing(missing)}")
    if unexpected:
        problems.append(f"checkpoint leaves the target does not have: {_listing(unexpected)}")
    for name, leaf in wanted.items():
        meta = saved.get(name)
        if meta is None:
            continue
        shape, dtype = getattr(meta, "shape", None), getattr(meta, "dtype", None)
        if shape is None or dtype is None:
            problems.append(f"checkpoint leaf {name} is not an array ({type(meta).__name__})")
            continue
        if tuple(shape) != tuple(leaf.shape):
            problems.append(
                f"leaf {name}: checkpoint shape {tuple(shape)} != target shape {tuple(leaf.shape)}"
            )
        if not _dtype_change_allowed(np.dtype(dtype), np.dtype(leaf.dtype)):
            problems.append(
                f"leaf {name}: checkpoint dtype {np.dtype(dtype)} cannot be restored as "
                f"{np.dtype(leaf.dtype)} (only float -> float casts are allowed)"
            )
    if problems:
        raise CheckpointError(
            f"checkpoint {params_dir} does not match the restore target: " + "; ".join(problems)
        )


def saved_leaves(path: str | os.PathLike) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Leaf path -> (shape, dtype) of the checkpoint `save_params` wrote at `path`, read from its
    metadata only (e.g. to tell a quantized checkpoint from a float one before restoring)."""
    params_dir = Path(path) / PARAMS_DIR
    if not is_orbax_checkpoint(path):
        raise CheckpointError(f"{params_dir} is not a finished Orbax checkpoint")
    with ocp.StandardCheckpointer() as checkpointer:
        tree = getattr(checkpointer.metadata(params_dir.absolute()).item_metadata, "tree", None)
    if tree is None:
        raise CheckpointError(f"checkpoint {params_dir} has no readable pytree metadata")
    return {
        name: (tuple(meta.shape), np.dtype(meta.dtype))
        for name, meta in _named_leaves(tree)
        if getattr(meta, "shape", None) is not None and getattr(meta, "dtype", None) is not None
    }


def restore_params(path: str | os.PathLike, target: Any) -> Any:
    """Restores the params saved by `save_params` straight into the target's shardings.

    Args:
      path: the directory given to `save_params` (holding `params/`).
      target: pytree with the params' structure whose leaves are `jax.ShapeDtypeStruct` with
        `.sharding` set (or `jax.Array`s, whose shape/dtype/sharding are used; or `np.ndarray`s,
        restored as host arrays). Floating leaves may name a different floating dtype (cast
        while reading).

    Returns:
      A pytree of the target's structure and types, each array on its target sharding.
    """
    path = Path(path)
    params_dir = path / PARAMS_DIR
    if not params_dir.is_dir():
        raise CheckpointError(f"no params checkpoint at {params_dir}")
    if not is_orbax_checkpoint(path):
        raise CheckpointError(
            f"{params_dir} is not a finished Orbax checkpoint (missing {' / '.join(ORBAX_MARKERS)})"
        )
    target_leaves = [(name, _abstract_leaf(name, leaf)) for name, leaf in _named_leaves(target)]
    if not target_leaves:
        raise CheckpointError(f"restore target for {params_dir} has no leaves")
    _check_against_metadata(params_dir, target_leaves)

    abstract = jax.tree_util.tree_unflatten(
        jax.tree_util.tree_structure(target), [leaf for _, leaf in target_leaves]
    )
    try:
        with ocp.StandardCheckpointer() as checkpointer:
            return checkpointer.restore(params_dir.absolute(), abstract)
    except (ValueError, FileNotFoundError) as e:
        raise CheckpointError(f"orbax failed to restore {params_dir}: {e}") from e
