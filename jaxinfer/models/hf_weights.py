"""Filling a family's params tree from Hugging Face checkpoint tensors (shared by every family).

1. A family maps each HF tensor name to an entry `(path into its Params, transform from the HF
   layout to ours[, slot])` (e.g. `llama_weights.hf_name_map`); `moe_expert_names` gives the expert
   tensors of a sparse layer in either of the layouts checkpoints use.
2. `fill_params(specs, name_map, names, get_tensor, put, ...)` reads every tensor once, checks it
   against its `ParamSpec` (or quantizes it on the host into a `QArray` leaf), assembles fused
   leaves from their slots, and places each leaf with `put` once it is whole. Unexpected, missing
   and mis-shaped tensors raise, naming them.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from checkpoints import quantize as qlib
from jaxinfer.config import ModelConfig
from jaxinfer.params import ParamSpec, checked_array, is_spec, map_specs
from jaxinfer.quantization import QArray, quantization_of

# Tensors some checkpoints carry that hold no weights of ours.
IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


def ident(x):
    return x


def transpose(x):  # HF linear [out, in] -> ours [in, out]
    return x.T


transpose.hf_linear = True  # type: ignore[attr-defined]


def transpose_to(*out_dims: int) -> Callable[[np.ndarray], np.ndarray]:
    """HF linear [out, in] -> ours [in, *out_dims] (the output dim split, e.g. into KV groups of
    heads). Applies alike to a source's quantized rows and their scales ([out, G] -> [G, ...])."""

    def split(x: np.ndarray) -> np.ndarray:
        return x.T.reshape(x.shape[1], *out_dims)

    split.hf_linear = True  # type: ignore[attr-defined]
    return split


def moe_expert_names(
    cfg: ModelConfig,
    i: int,
    names: Iterable[str],
    block: str = "mlp",
    parts: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
) -> dict[str, tuple]:
    """Expert tensors of sparse layer `i`, in the layout the checkpoint uses.

    Hub checkpoints (and transformers 5's `save_pretrained`) store one tensor per expert: the
    router `{block}.gate` and `{block}.experts.{j}.{gate,up,down}` named by `parts` (Mixtral:
    `block_sparse_moe`, `w1/w3/w2`; Qwen3-MoE and DeepSeek: `mlp`, `gate_proj/up_proj/down_proj`).
    transformers 5 models hold them fused in memory (`mlp.experts.gate_up_proj [X, 2F, E]`,
    `mlp.experts.down_proj [X, E, F]`, router `mlp.gate`); a state dict taken from such a model
    uses that form.
    """
    x, e, fm = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    L = ("layers", i, "mlp")
    fused = f"model.layers.{i}.mlp.experts.gate_up_proj"
    if fused in set(names):
        p = f"model.layers.{i}.mlp."
        return {
            p + "gate.weight": (L + ("router",), lambda t: t.T),
            fused: (L + ("gate_up",), lambda t: t.reshape(x, 2, fm, e).transpose(0, 3, 1, 2)),
            p + "experts.down_proj": (L + ("down",), lambda t: t.transpose(0, 2, 1)),
        }
    p = f"model.layers.{i}.{block}."
    out = {p + "gate.weight": (L + ("router",), lambda t: t.T)}
    for j in range(x):
        q = f"{p}experts.{j}."
        out[q + parts[0] + ".weight"] = (L + ("gate_up",), transpose, (j, slice(None), 0))
        out[q + parts[1] + ".weight"] = (L + ("gate_up",), transpose, (j, slice(None), 1))
        out[q + parts[2] + ".weight"] = (L + ("down",), transpose, (j,))
    return out


def _get_path(tree: Any, path: tuple) -> Any:
    for key in path:
        tree = tree[key] if isinstance(key, int) else getattr(tree, key)
    return tree


def _set_path(tree: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    key, rest = path[0], path[1:]
    if isinstance(key, int):
        items = list(tree)
        items[key] = _set_path(items[key], rest, value)
        return tuple(items)
    return tree.replace(**{key: _set_path(getattr(tree, key), rest, value)})


def fill_params(
    specs: Any,
    name_map: dict[str, tuple | list[tuple]],
    names: list[str],
    get_tensor: Callable[[str], np.ndarray],
    put: Callable[[np.ndarray, ParamSpec], Any] | None,
    *,
    what: str,
    skip: Callable[[str], bool],
    get_quantized: Callable[[str, str, int], tuple[np.ndarray, ...] | None] | None = None,
    quantization: str | None = None,
) -> Any:
    """The spec tree `specs` filled from the checkpoint tensors `names` through `name_map`.

    `name_map[name]` is one entry `(path, transform[, slot])` (see `llama_weights.hf_name_map`) or
    a list of them (one tensor feeding several leaves); names `skip` accepts are ignored. `QArray`
    specs are filled quantized (see `llama.params_from_hf`, whose `get_quantized` this takes;
    `quantization`, the requested format, gives the options the specs do not show, e.g. "-sym").
    Raises on unexpected, missing or mis-shaped tensors, naming them.
    """
    put = put or (lambda x, spec: jnp.asarray(x))
    unexpected = [n for n in names if n not in name_map and not skip(n)]
    if unexpected:
        raise ValueError(
            f"unexpected tensors in checkpoint for {what}: {unexpected[:8]}"
            + (f" (+{len(unexpected) - 8} more)" if len(unexpected) > 8 else "")
        )
    missing = [n for n in name_map if n not in set(names)]
    if missing:
        raise ValueError(
            f"checkpoint is missing tensors: {missing[:8]}"
            + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else "")
        )
    entries = {n: e if isinstance(e, list) else [e] for n, e in name_map.items()}
    params = map_specs(lambda s: None, specs)
    fused: dict[
        tuple, Any
    ] = {}  # path -> host buffer (a QArray of two when quantized) being filled
    parts_left: dict[tuple, int] = {}  # path -> slots not yet filled
    perms: dict[tuple, np.ndarray] = {}  # path -> the act-order permutation of its first slot
    for path, _, *slot in (e for es in entries.values() for e in es):
        if slot:
            parts_left[path] = parts_left.get(path, 0) + 1
    for name, targets in entries.items():
        raw: list[np.ndarray] = []  # the float tensor, read once when a target needs it

        def read(name=name, raw=raw) -> np.ndarray:
            if not raw:
                raw.append(np.asarray(get_tensor(name)))
            return raw[0]

        for path, transform, *slot in targets:
            spec = _get_path(specs, path)
            quantized = isinstance(spec, QArray)
            shape = spec.data.shape if quantized else spec.shape
            index = None
            if slot:
                index = slot[0] if isinstance(slot[0], tuple) else (..., slot[0], slice(None))
                index = _full_index(index, len(shape))
            if quantized:
                value = _quantized_part(
                    name, spec, index, transform, read, get_quantized, quantization
                )
            else:
                part = spec
                if slot:
                    part_shape = np.broadcast_to(np.empty((), np.int8), shape)[index].shape
                    part = dataclasses.replace(
                        spec, shape=part_shape, logical_axes=(None,) * len(part_shape)
                    )
                try:
                    value = transform(read())
                except ValueError:
                    raise ValueError(
                        f"tensor {name!r} has shape {read().shape}, which does not fit {shape}"
                    ) from None
                value = checked_array(name, value, part)
            if not slot:
                params = _set_path(params, path, _put_leaf(put, value, spec))
                continue
            if quantized:
                buf = fused.setdefault(
                    path, jax.tree.map(lambda s: np.empty(s.shape, s.dtype), spec, is_leaf=is_spec)
                )
                # NOTE: slots index axes other than the contraction
                jax.tree.map(
                    lambda b, v, i=index: b.__setitem__(i, v),
                    buf.replace(perm=None),
                    value.replace(perm=None),
                )
                if value.perm is not None:  # one input order for every slot (they share x)
                    first = perms.setdefault(path, value.perm)
                    if not np.array_equal(first, value.perm):
                        raise ValueError(
                            f"tensor {name!r}: its act-order permutation (g_idx) differs from "
                            "that of the tensors fused with it, which read the same input"
                        )
                    buf.perm[:] = value.perm
            else:
                buf = fused.setdefault(path, np.empty(spec.shape, spec.dtype))
                buf[index] = value
            parts_left[path] -= 1
            if not parts_left[path]:  # NOTE: slots never overlap; a leaf is placed once all are in
                params = _set_path(params, path, _put_leaf(put, fused.pop(path), spec))
    return params


def _put_leaf(put: Callable[[np.ndarray, ParamSpec], Any], value: Any, spec: Any) -> Any:
    if isinstance(spec, QArray):
        return jax.tree.map(put, value, spec, is_leaf=is_spec)
    return put(value, spec)


def _full_index(index: tuple, ndim: int) -> tuple:
    """`index` with its Ellipsis expanded into slices: one entry per axis of an `ndim` array."""
    if Ellipsis not in index:
        return tuple(index) + (slice(None),) * (ndim - len(index))
    at = index.index(Ellipsis)
    fill = (slice(None),) * (ndim - len(index) + 1)
    return tuple(index[:at]) + fill + tuple(index[at + 1 :])


def _quantized_part(
    name: str,
    spec: QArray,
    index: tuple | None,
    transform: Callable,
    read: Callable[[], np.ndarray],
    get_quantized: Callable[[str, str, int], Any] | None,
    quantization: str | None = None,
) -> QArray:
    """One HF tensor as the quantized piece `index` (None: all) of the leaf `spec` (host arrays):
    the source's own quantized form when `get_quantized` has it in this layout, else quantized
    here (int4 leaves with `quantization`'s options)."""
    fmt = quantization_of(spec)
    axis = spec.data.quant_axis
    groups = spec.scale.shape[axis]
    shape = spec.data.shape
    if index is not None:
        shape = np.broadcast_to(np.empty((), np.int8), shape)[index].shape
        axis -= sum(isinstance(x, int) for x in index[:axis])  # integer entries drop their axes
    # A source's own quantized rows ([out, in], scales [out, G] along `in`) fit a piece contracted
    # over HF's `in`: axis 0 after the transpose of a linear weight (its output dim possibly split
    # into heads, `transpose_to`), axis 1 of a 2-D embedding.
    native = None
    hf_linear = getattr(transform, "hf_linear", False) and axis == 0
    if get_quantized is not None and (
        hf_linear or (transform is ident and axis == 1 and len(shape) == 2)
    ):
        asked = quantization if spec.offset is not None and quantization else fmt
        native = get_quantized(name, asked, groups)
    perm = None
    if isinstance(native, qlib.Permuted):  # act-order: the input rows' order rides beside
        native, perm = native.parts, np.asarray(native.perm, np.int32)
    if native is not None:
        native = tuple(map(transform, native))
    else:
        raw = read()
        try:
            value = transform(raw)
        except ValueError:
            raise ValueError(
                f"tensor {name!r} has shape {raw.shape}, which does not fit {shape}"
            ) from None
        if tuple(value.shape) != tuple(shape):
            raise ValueError(f"tensor {name!r} has shape {tuple(value.shape)}, expected {shape}")
        if spec.offset is not None:
            symmetric = bool(quantization) and qlib.parse_format(quantization)[2]
            native = qlib.quantize4(value, axis, groups, symmetric)
        else:
            native = qlib.quantize(value, fmt, axis, groups, scale_dtype=spec.scale.dtype)
    data = native[0]
    if tuple(data.shape) != tuple(shape):
        raise ValueError(f"tensor {name!r} has shape {tuple(data.shape)}, expected {shape}")
    if (len(native) == 3) != (spec.offset is not None):
        raise ValueError(f"tensor {name!r}: the source's quantized form does not fit {fmt}")
    # NOTE: a source's f32 scales narrow to the leaf's f16 under int4 (GGUF Q8_0's folded scales,
    # block scales of f16 values, exactly).
    rest = [np.asarray(x, spec.scale.dtype) for x in native[1:]]
    if spec.perm is None and perm is not None:  # one scale group (or none): order is moot
        if not np.array_equal(perm, np.arange(perm.shape[0])):
            raise ValueError(f"tensor {name!r}: an act-order weight, but {fmt} has none")
        perm = None
    if spec.perm is not None and perm is None:  # not act-order in the source: identity
        perm = np.arange(spec.perm.shape[0], dtype=np.int32)
    return QArray(np.asarray(data, spec.data.dtype), *rest).replace(perm=perm)
