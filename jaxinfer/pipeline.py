"""Pipeline parallelism: decoder layers split into contiguous stages over the `pipeline` axis.

1. Stage layout. With `S` stages, `num_layers % S == 0` and stage `s` owns layers
   `s*Lps .. (s+1)*Lps - 1` (`Lps = num_layers // S`). `check_stages` says which sizes work.
2. Stacked-by-stage params. The canonical (checkpoint) layout keeps `layers` a flat tuple of `L`
   per-layer dataclasses. On a pipeline mesh `layers` becomes a tuple of `Lps` dataclasses whose
   leaves carry a leading stage dim `[S, ...]` with logical axis `layers` (-> `pipeline` in
   `RULES`): position `j` of stage `s` is canonical layer `s*Lps + j`, and inside `shard_map` each
   device sees only its own stage's layers. `stack_stages` converts specs (shapes + logical axes)
   or host arrays; `place_stacked_layers` builds the stacked device arrays from canonical
   per-layer arrays shard by shard (each device receives only the slices it holds, never a full
   host copy of the model); `unstack_stages` goes back to the canonical layout. Loading: orbax
   restores the canonical checkpoint into `canonical_targets` (layer i on its stage's devices)
   and `to_stacked` assembles the stacked arrays from those very shards; converting once and
   restoring on any mesh therefore works.
3. KV caches follow the layers: per stage position `j` one cache `[S, P, page, 2*Hkv, D]` sharded
   on `pipeline` (`stage_kv_caches`), so each layer's cache lives on its stage's devices only.
4. `schedule(M, S)` is the tick table: at tick `t` stage `s` works on micro-batch `t - s`, so
   `M + S - 1` ticks run `M` micro-batches through `S` stages and stages overlap.
5. `run_pipeline` (inside `shard_map`) runs that schedule: every tick each stage applies its layers
   to the micro-batch it holds, then hands the activations to the next stage with `ppermute`. The
   last stage's outputs (after `output_fn`, e.g. only the logits rows) are broadcast over
   `pipeline` with one masked `psum` at the end, so the LM head sees them on every device.
6. `pipelined_decoder` is what the model's forward calls on a pipeline mesh: the step holds M
   ragged micro-batches of whole sequences stacked on a leading [M] dim (a sequence never spans
   two micro-batches, so no micro-batch reads KV another one writes in the same step); it runs
   the decoder layers through `run_pipeline` and returns the hidden rows at `logits_indices`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxinfer import sharding as shd
from jaxinfer.params import ParamSpec, is_spec

LAYERS_AXIS = "layers"  # logical axis of the stage dim (RULES maps it to `pipeline`)


def check_stages(num_layers: int, num_stages: int) -> int:
    """Layers per stage; raises naming the pipeline sizes that divide `num_layers`."""
    if num_stages < 1 or num_layers % num_stages:
        ok = [s for s in range(1, num_layers + 1) if num_layers % s == 0]
        raise ValueError(
            f"pipeline={num_stages} does not divide the model's {num_layers} layers "
            f"into equal stages; use pipeline in {ok}"
        )
    return num_layers // num_stages


def stage_of_layer(layer: int, num_layers: int, num_stages: int) -> tuple[int, int]:
    """Canonical layer index -> (stage, position within the stage)."""
    lps = check_stages(num_layers, num_stages)
    return layer // lps, layer % lps


def _layers_of(tree: Any) -> tuple:
    return tree if isinstance(tree, tuple) else tree.layers


def _with_layers(tree: Any, layers: tuple) -> Any:
    return layers if isinstance(tree, tuple) else tree.replace(layers=layers)


def _layer_kind(layer: Any) -> tuple:
    """Tree structure + leaf shapes/dtypes: layers stacked together must agree on it."""
    leaves, treedef = jax.tree.flatten(layer, is_leaf=is_spec)
    return treedef, tuple((tuple(x.shape), str(jnp.dtype(x.dtype))) for x in leaves)


def _check_uniform(layers: Sequence[Any], num_stages: int) -> int:
    """Layers per stage; raises when a stage position would stack layers of different kinds."""
    lps = check_stages(len(layers), num_stages)
    kinds = [_layer_kind(layer) for layer in layers]

    def uniform(n: int) -> bool:
        per = len(layers) // n
        return all(kinds[s * per + j] == kinds[j] for s in range(n) for j in range(per))

    if not uniform(num_stages):
        ok = [n for n in range(1, len(layers) + 1) if len(layers) % n == 0 and uniform(n)]
        raise ValueError(
            f"pipeline={num_stages} would stack layers of different kinds (e.g. dense "
            f"and MoE MLPs) at the same stage position; use pipeline in {ok}"
        )
    return lps


def _stack_leaves(*leaves: Any) -> Any:
    first = leaves[0]
    if is_spec(first):
        return ParamSpec(
            (len(leaves),) + tuple(first.shape),
            first.dtype,
            (LAYERS_AXIS,) + tuple(first.logical_axes),
            first.init,
            first.scale,
            None if first.quant_axis is None else first.quant_axis + 1,
        )
    if isinstance(first, np.ndarray):
        return np.stack(leaves)
    return jnp.stack(leaves)


def stack_stages(tree: Any, num_stages: int) -> Any:
    """Canonical `layers` (flat tuple of L) -> stacked-by-stage (tuple of L/S with [S, ...] leaves).

    `tree` is a params tree (anything with `.layers`) or the layers tuple itself, holding
    `ParamSpec`s, host arrays or (single-device) jax arrays. Other fields are left as they are.
    For device arrays on a mesh use `place_stacked_layers`, which avoids gathering to one place.
    """
    layers = _layers_of(tree)
    lps = _check_uniform(layers, num_stages)
    stacked = tuple(
        jax.tree.map(
            _stack_leaves, *[layers[s * lps + j] for s in range(num_stages)], is_leaf=is_spec
        )
        for j in range(lps)
    )
    return _with_layers(tree, stacked)


def unstack_stages(tree: Any) -> Any:
    """Stacked-by-stage `layers` -> the canonical flat tuple (layer s*Lps + j = stage s, slot j)."""
    stacked = _layers_of(tree)
    if not stacked:
        return tree
    num_stages = jax.tree.leaves(stacked[0], is_leaf=is_spec)[0].shape[0]

    def pick(leaf, s):
        if is_spec(leaf):
            if leaf.logical_axes[:1] != (LAYERS_AXIS,):
                raise ValueError(
                    f"{leaf} has no leading {LAYERS_AXIS!r} axis: not stacked by stage"
                )
            return ParamSpec(
                leaf.shape[1:],
                leaf.dtype,
                leaf.logical_axes[1:],
                leaf.init,
                leaf.scale,
                None if leaf.quant_axis is None else leaf.quant_axis - 1,
            )
        return leaf[s]

    layers = tuple(
        jax.tree.map(lambda x, s=s: pick(x, s), stacked[j], is_leaf=is_spec)
        for s in range(num_stages)
        for j in range(len(stacked))
    )
    return _with_layers(tree, layers)


def _norm_index(index: tuple, shape: Sequence[int]) -> tuple:
    return tuple(
        (sl.indices(n)[:2] if isinstance(sl, slice) else (sl, sl + 1))
        for sl, n in zip(index, shape)
    )


def _local_piece(src: Any, rest: tuple, device: jax.Device, dtype: Any) -> Any:
    """`src[rest]` on `device`: the source's own shard when it already sits there (no copy)."""
    if isinstance(src, np.ndarray):
        return np.asarray(src[rest], dtype)
    want = _norm_index(rest, src.shape)
    for shard in src.addressable_shards:
        if shard.device == device and _norm_index(shard.index, src.shape) == want:
            return shard.data.astype(dtype)
    return jax.device_put(src[rest], device).astype(dtype)


def _assemble(
    sources: Sequence[Any], sharding: NamedSharding, dtype: Any, delete_sources: bool = False
) -> jax.Array:
    """One stacked [S, ...] array from per-stage sources, built shard by shard on its devices.

    NOTE: each device receives only the slice of its own stage (and its own tensor shard): a
    host numpy source is sliced on the host, a jax array source already on its stage's devices
    (`canonical_targets`, e.g. restored from orbax) gives its own shard (one copy on the same
    device for the [1, ...] reshape, no transfer), any other jax array is sliced where it lives
    and the slice moved. No device ever holds another stage's layer, and no full copy is made on
    the host.
    """
    shape = (len(sources),) + tuple(sources[0].shape)
    arrays = []
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        parts = [
            _local_piece(sources[s], tuple(index[1:]), device, dtype)
            for s in range(len(sources))[index[0]]
        ]
        if len(parts) == 1:
            piece = jax.device_put(parts[0][None], device)
        else:
            piece = jax.device_put(
                np.stack(parts)
                if isinstance(parts[0], np.ndarray)
                else jnp.stack([jax.device_put(p, device) for p in parts]),
                device,
            )
        arrays.append(piece)
    out = jax.make_array_from_single_device_arrays(shape, sharding, arrays)
    if delete_sources:
        jax.block_until_ready(out)
        for src in sources:
            if isinstance(src, jax.Array):
                src.delete()
    return out


def place_stacked_layers(
    canonical_layers: Sequence[Any],
    stacked_specs: Any,
    mesh: Mesh,
    *,
    rules: dict,
    delete_sources: bool = False,
) -> tuple:
    """Per-layer arrays (host numpy or jax arrays) -> stacked-by-stage arrays on `mesh`.

    `rules` here and in the functions below is the model's logical-axis table for this mesh,
    `sharding.model_rules(cfg, Parallel.from_mesh(mesh))` (the raw `RULES` would split dense
    weights over expert x tensor whatever the model can take).

    `stacked_specs` is `stack_stages(param_specs(...), S)` (or its `.layers`); each leaf lands on
    the sharding its logical axes ask for, stage dim on `pipeline`. `delete_sources` frees each
    jax source leaf once its stacked array exists, so a device's peak is its share plus one leaf.
    """
    specs = _layers_of(stacked_specs)
    num_stages = jax.tree.leaves(specs[0], is_leaf=is_spec)[0].shape[0]
    lps = check_stages(len(canonical_layers), num_stages)
    out = []
    for j, spec_j in enumerate(specs):
        sources = [canonical_layers[s * lps + j] for s in range(num_stages)]
        out.append(
            jax.tree.map(
                lambda spec, *src: _assemble(
                    src, _sharding(mesh, spec, rules), spec.dtype, delete_sources
                ),
                spec_j,
                *sources,
                is_leaf=is_spec,
            )
        )
    return tuple(out)


def _sharding(mesh: Mesh, spec: ParamSpec, rules: dict) -> NamedSharding:
    return NamedSharding(mesh, shd.logical_to_spec(spec.logical_axes, rules))


def stage_mesh(mesh: Mesh, stage: int) -> Mesh:
    """The devices of one pipeline stage, as a mesh with the same axis names (pipeline size 1)."""
    ax = mesh.axis_names.index(shd.PIPELINE)
    return Mesh(np.take(mesh.devices, [stage], axis=ax), mesh.axis_names)


def canonical_targets(specs: Any, mesh: Mesh, rules: dict) -> Any:
    """Restore target (sharded ShapeDtypeStructs) of the canonical layout on a pipeline mesh.

    Layer `i` goes to stage `i // Lps`'s devices only (split there by its other logical axes);
    everything else to the whole mesh. `to_stacked` then assembles the stacked layout from those
    shards without moving any data.
    """
    num_stages = mesh.shape[shd.PIPELINE]
    layers = specs.layers
    lps = check_stages(len(layers), num_stages)

    def target(spec, m):
        return jax.ShapeDtypeStruct(spec.shape, spec.dtype, sharding=_sharding(m, spec, rules))

    whole = jax.tree.map(lambda sp: target(sp, mesh), specs.replace(layers=()), is_leaf=is_spec)
    stage_meshes = [stage_mesh(mesh, s) for s in range(num_stages)]
    return whole.replace(
        layers=tuple(
            jax.tree.map(lambda sp, m=stage_meshes[i // lps]: target(sp, m), layer, is_leaf=is_spec)
            for i, layer in enumerate(layers)
        )
    )


def to_stacked(
    params: Any, specs: Any, mesh: Mesh, *, rules: dict, delete_sources: bool = False
) -> Any:
    """Canonical params (host or device arrays) -> stacked-by-stage params placed on `mesh`.

    `specs` is the canonical spec tree (`param_specs(cfg)`). Non-layer leaves are placed by their
    logical axes; layers by `place_stacked_layers` (`delete_sources` frees the canonical layer
    arrays as it goes).
    """
    num_stages = mesh.shape[shd.PIPELINE]
    stacked_specs = stack_stages(specs, num_stages)
    rest = jax.tree.map(
        lambda sp, x: jax.device_put(x, _sharding(mesh, sp, rules)),
        specs.replace(layers=()),
        params.replace(layers=()),
        is_leaf=is_spec,
    )
    return rest.replace(
        layers=place_stacked_layers(
            params.layers, stacked_specs, mesh, delete_sources=delete_sources, rules=rules
        )
    )


def place_params(params: Any, specs: Any, mesh: Mesh, rules: dict) -> Any:
    """Params for a pipeline mesh, canonical or already stacked (e.g. from the loader).

    A stacked tree is `device_put` onto its shardings (a no-op when already there); a canonical
    one goes through `to_stacked`.
    """
    num_stages = mesh.shape[shd.PIPELINE]
    if len(params.layers) == len(specs.layers):
        return to_stacked(params, specs, mesh, rules=rules)
    stacked_specs = stack_stages(specs, num_stages)
    if len(params.layers) != len(stacked_specs.layers):
        raise ValueError(
            f"params hold {len(params.layers)} layers: neither the model's "
            f"{len(specs.layers)} nor {len(stacked_specs.layers)} stacked by "
            f"pipeline={num_stages}"
        )
    return jax.device_put(
        params, jax.tree.map(lambda sp: _sharding(mesh, sp, rules), stacked_specs, is_leaf=is_spec)
    )


def stage_kv_caches(
    num_layers: int,
    num_stages: int,
    shape: Sequence[int],
    dtype: Any,
    mesh: Mesh,
    inner_spec: PartitionSpec | None = None,
    fill: float = 0.0,
) -> tuple[jax.Array, ...]:
    """Per stage position one cache `[S, *shape]`, stage dim on `pipeline`, created in place.

    `inner_spec` shards the per-layer dims (e.g. pages on `data`, KV heads on `tensor`).
    """
    lps = check_stages(num_layers, num_stages)
    sharding = NamedSharding(mesh, PartitionSpec(shd.PIPELINE, *(inner_spec or ())))
    full = (num_stages,) + tuple(shape)
    make = jax.jit(lambda: jnp.full(full, fill, dtype), out_shardings=sharding)
    return tuple(make() for _ in range(lps))


def stack_kv_caches(caches: Sequence[Any], num_stages: int) -> tuple:
    """Canonical per-layer caches -> per stage position `[S, ...]` (layer s*Lps + j at [s])."""
    lps = check_stages(len(caches), num_stages)
    return tuple(jnp.stack([caches[s * lps + j] for s in range(num_stages)]) for j in range(lps))


def unstack_kv_caches(caches: Sequence[Any]) -> tuple:
    """Per stage position `[S, ...]` caches -> canonical per-layer caches."""
    num_stages = caches[0].shape[0]
    return tuple(caches[j][s] for s in range(num_stages) for j in range(len(caches)))


def split_microbatches(token_counts: Sequence[int], num_microbatches: int) -> list[list[int]]:
    """Sequence indices per micro-batch: contiguous runs of whole sequences, balanced by tokens.

    NOTE: contiguous keeps the decodes-first order inside every micro-batch, and whole sequences
    mean no micro-batch ever attends to KV that a later micro-batch of the same step writes. A
    micro-batch may be empty (fewer sequences than micro-batches).
    """
    total = sum(token_counts)
    groups: list[list[int]] = [[] for _ in range(num_microbatches)]
    start = 0
    for i, n in enumerate(token_counts):
        # the micro-batch whose share of the token axis holds this sequence's midpoint
        g = min(num_microbatches - 1, int((start + n / 2) * num_microbatches / max(total, 1)))
        groups[g].append(i)
        start += n
    return groups


def schedule(num_microbatches: int, num_stages: int) -> list[list[tuple[int, int]]]:
    """Per tick, the (stage, micro-batch) pairs at work: stage s holds micro-batch t - s."""
    return [
        [(s, t - s) for s in range(num_stages) if 0 <= t - s < num_microbatches]
        for t in range(num_microbatches + num_stages - 1)
    ]


def run_pipeline(
    stage_fn: Callable[[Any, Any, jax.Array, Any, jax.Array], tuple[jax.Array, Any]],
    stage_params: Any,
    stage_caches: Any,
    microbatch_inputs: Any,
    first_inputs: jax.Array,  # [M, ...] activations entering stage 0, per micro-batch
    *,
    num_stages: int,
    axis: str = shd.PIPELINE,
    output_fn: Callable[[jax.Array, Any], jax.Array] | None = None,
) -> tuple[jax.Array, Any]:
    """Runs M micro-batches through the stages; call inside `shard_map` over `axis`.

    Args:
      stage_fn: `(params, caches, h, inputs, active) -> (h, caches)` applies this device's stage
        to one micro-batch. `active` (bool scalar) is False on bubble ticks: the stage must then
        leave its state unchanged (e.g. write no KV: slot_mapping -> -1); its `h` is discarded.
      stage_params, stage_caches: this device's local blocks of the stacked trees (leading stage
        dim of size 1, as `shard_map` hands them over).
      microbatch_inputs: pytree with a leading [M] dim (same on every stage).
      output_fn: `(h, inputs) -> y` applied to the last stage's activations (default identity).
    Returns:
      (`[M, ...]` last-stage outputs, replicated over `axis`; updated caches, stage dim kept).
    """
    num_mb = first_inputs.shape[0]
    output_fn = output_fn or (lambda h, _: h)
    stage = jax.lax.axis_index(axis) if num_stages > 1 else jnp.int32(0)
    params = jax.tree.map(lambda a: a[0], stage_params)
    caches = jax.tree.map(lambda a: a[0], stage_caches)
    forward_perm = [(s, s + 1) for s in range(num_stages - 1)]
    received = jnp.zeros_like(first_inputs[0])
    outputs = []
    # NOTE: a Python loop over the M + S - 1 ticks (unrolled): the micro-batch index is dynamic
    # (it depends on the stage), but every shape is static and XLA:CPU runs unrolled layers faster
    # than a scan. Bubble ticks still compute (SPMD), masked so they change no state.
    for tick in range(num_mb + num_stages - 1):
        mb = tick - stage
        active = (mb >= 0) & (mb < num_mb)
        idx = jnp.clip(mb, 0, num_mb - 1)
        inputs = jax.tree.map(
            lambda a, i=idx: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), microbatch_inputs
        )
        h = received
        if num_stages == 1:
            h = first_inputs[tick]
        else:
            h = jnp.where(
                stage == 0, jax.lax.dynamic_index_in_dim(first_inputs, idx, keepdims=False), h
            )
        with jax.named_scope(f"pipeline_tick_{tick}"):
            h, caches = stage_fn(params, caches, h, inputs, active)
        if tick >= num_stages - 1:  # the last stage finished micro-batch tick - (S - 1)
            last_inputs = jax.tree.map(lambda a, m=tick - num_stages + 1: a[m], microbatch_inputs)
            outputs.append(output_fn(h, last_inputs))
        if num_stages > 1 and tick < num_mb + num_stages - 2:
            received = jax.lax.ppermute(h, axis, forward_perm)
    out = jnp.stack(outputs)
    if num_stages > 1:
        with jax.named_scope("pipeline_broadcast"):
            out = jax.lax.psum(jnp.where(stage == num_stages - 1, out, jnp.zeros_like(out)), axis)
    return out, jax.tree.map(lambda a: a[None], caches)


def stage_windows(layer_windows: Sequence[int | None], num_stages: int) -> tuple[int | None, ...]:
    """Sliding window per stage position; every stage must agree (the window is static)."""
    lps = check_stages(len(layer_windows), num_stages)
    out = []
    for j in range(lps):
        ws = {layer_windows[s * lps + j] for s in range(num_stages)}
        if len(ws) > 1:
            ok = [
                n
                for n in range(1, len(layer_windows) + 1)
                if len(layer_windows) % n == 0
                and all(
                    len({layer_windows[s * (len(layer_windows) // n) + i] for s in range(n)}) == 1
                    for i in range(len(layer_windows) // n)
                )
            ]
            raise ValueError(
                f"pipeline={num_stages} puts layers with different sliding windows "
                f"{sorted(ws, key=str)} at stage position {j}; use pipeline in {ok}"
            )
        out.append(ws.pop())
    return tuple(out)


def pipelined_decoder(
    layer_fn: Callable[..., tuple[jax.Array, jax.Array]],
    stage_layers: tuple,
    stage_caches: tuple[jax.Array, ...],  # per stage position, local block [1, P, page, 2*Hkv, D]
    h: jax.Array,  # [M, T, E] embedded tokens per micro-batch
    step: Any,  # StepInputs with a leading [M] dim on every field
    cos: jax.Array,  # [M, T, ...] rope tables per micro-batch
    sin: jax.Array,
    *,
    windows: Sequence[int | None],
    num_stages: int,
    axis: str = shd.PIPELINE,
) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """The decoder layers of a pipeline mesh; call inside `shard_map`.

    `layer_fn(layer_params, window, h, step, cos, sin, kv_cache) -> (h, kv_cache)` is one decoder
    layer. Returns (`[M, N, E]` hidden rows at each micro-batch's `logits_indices`, replicated over
    `axis`; updated caches).
    """

    def stage_fn(layers, caches, x, inputs, active):
        mb_step, mb_cos, mb_sin = inputs
        # NOTE: a bubble tick runs on some other micro-batch's metadata; -1 slots write no KV.
        mb_step = mb_step.replace(slot_mapping=jnp.where(active, mb_step.slot_mapping, -1))
        new = []
        for j, layer in enumerate(layers):
            with jax.named_scope(f"stage_layer_{j}"):
                x, cache = layer_fn(layer, windows[j], x, mb_step, mb_cos, mb_sin, caches[j])
            new.append(cache)
        return x, tuple(new)

    def rows(x, inputs):
        return jnp.take(x, inputs[0].logits_indices, axis=0)

    return run_pipeline(
        stage_fn,
        stage_layers,
        tuple(stage_caches),
        (step, cos, sin),
        h,
        num_stages=num_stages,
        axis=axis,
        output_fn=rows,
    )
