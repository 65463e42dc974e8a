"""Mesh axes and the logical -> mesh sharding rules.

1. Mesh axes are named constants (`DATA`, `PIPELINE`, `EXPERT`, `TENSOR`); size-1 axes are free.
2. Model code names only logical axes (`vocab`, `embed`, `q_heads`, ...). `RULES` maps each
   logical axis to a mesh axis, a tuple of mesh axes (major first) or None; `logical_to_spec`
   turns an array's logical axes into a `PartitionSpec`, refusing a spec that would use one mesh
   axis twice (a collision), also inside tuples.
3. `make_mesh("tensor=4,pipeline=2")` builds the mesh the one mesh string used everywhere names
   (`config.parse_mesh` reads the string without JAX: the front end checks it, the core builds it).
4. `check_mesh(cfg, sizes, ...)` rejects a mesh the model or the engine cannot be split over, with
   a message that says what to change; `model_rules(cfg, par)` is `RULES` adjusted for the
   model: the dense (non-expert) weights' split dims (heads, vocab, dense MLP) go over `DENSE` =
   (`expert`, `tensor`) on MoE models, so the expert axis also works as tensor parallelism there,
   and over `tensor` alone on dense models (which reject expert > 1); K/V projections are
   replicated when the KV heads do not split over those shards.
5. `Parallel` is what model code sees when it runs inside `shard_map` over the mesh (manual SPMD):
   the axis sizes, a `psum` over the named axes that are split, this device's index on an axis,
   and `dense` / `dense_index()`: the dense weights' shard count (expert * tensor) and position.
   With every size 1 (the default) these are no-ops, so one model code path serves a single
   device and any mesh.
6. `device_put_global(tree, shardings)` places host data that every process holds in full onto
   a (multi-process) sharding: the loader's weights and the runner's step inputs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxinfer.config import MESH_AXES, parse_mesh

DATA, PIPELINE, EXPERT, TENSOR = MESH_AXES

# The mesh axes the dense (non-expert) weights split over on MoE models, major first: tokens stay
# replicated over `expert` outside the MoE block, so its devices can share attention, embedding,
# LM head and dense MLP layers as extra tensor parallelism instead of holding copies.
DENSE = (EXPERT, TENSOR)

MeshAxes = str | tuple[str, ...] | None

# logical axis -> mesh axis, tuple of mesh axes (major first), or None (replicated).
RULES: dict[str, MeshAxes] = {
    "vocab": DENSE,
    "embed": None,
    "q_heads": DENSE,
    "kv_heads": DENSE,
    "head_dim": None,
    "mlp": DENSE,  # a dense MLP's hidden dim
    "expert_mlp": TENSOR,  # an expert's hidden dim (the experts themselves are on EXPERT)
    "norm": None,
    "layers": PIPELINE,
    "experts": EXPERT,
    "batch": DATA,
    "pages": DATA,
    "page_slots": None,
}


def _flat(m: MeshAxes) -> tuple[str, ...]:
    return () if m is None else (m,) if isinstance(m, str) else tuple(m)


def logical_to_spec(
    axes: Sequence[str | None], rules: dict[str, MeshAxes] | None = None
) -> PartitionSpec:
    rules = RULES if rules is None else rules
    entries, used = [], []
    for ax in axes:
        if ax is not None and ax not in rules:
            raise ValueError(f"logical axis {ax!r} has no sharding rule (known: {sorted(rules)})")
        m = rules.get(ax) if ax is not None else None
        for name in _flat(m):
            if name in used:
                raise ValueError(f"logical axes {tuple(axes)} map mesh axis {name!r} twice")
            used.append(name)
        entries.append(m)
    return PartitionSpec(*entries)


def named_sharding(
    mesh: Mesh, axes: Sequence[str | None], rules: dict[str, MeshAxes] | None = None
) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(axes, rules))


def kv_heads_split(num_kv_heads: int, shards: int) -> bool:
    """True when the KV heads split over the `shards` of the attention weights (`Parallel.dense`);
    False when every shard keeps a replica of the one KV head its query heads need (`shards` a
    multiple of `num_kv_heads`)."""
    return num_kv_heads % shards == 0


def kv_cache_heads(num_kv_heads: int, shards: int) -> int:
    """KV heads in the global cache: `num_kv_heads`, or `shards` (one per shard) when replicated.

    NOTE: with replicated KV, shard j holds KV head j // (shards // num_kv_heads); shards sharing a
    head each keep (and write) their own copy, so attention never needs KV from another shard.
    """
    return num_kv_heads if kv_heads_split(num_kv_heads, shards) else shards


def is_moe(cfg) -> bool:
    return bool(getattr(cfg, "num_experts", 0))


def dense_axes(cfg, par: Parallel) -> str | tuple[str, ...]:
    """The spec entry of the dense weights' split dims (heads, vocab, dense MLP), of the KV cache's
    heads and of the logits' vocab: `DENSE` (expert x tensor) on MoE models and on any mesh with
    expert > 1, else `TENSOR`.

    NOTE: on a dense model the expert axis is simply more tensor parallelism (there are no experts
    to place on it); `TENSOR` otherwise keeps dense models' specs as they were.
    """
    return DENSE if is_moe(cfg) or par.expert > 1 else TENSOR


def model_rules(cfg, par: Parallel) -> dict[str, MeshAxes]:
    """`RULES` for this model on a mesh with `par`'s sizes: `DENSE` narrowed to `dense_axes(cfg, par)`,
    and K/V projection weights replicated when the KV heads do not split over `par.dense` shards
    (each shard then slices out its own head)."""
    dense = dense_axes(cfg, par)
    rules = {k: dense if v == DENSE else v for k, v in RULES.items()}
    if not kv_heads_split(cfg.num_kv_heads, par.dense):
        rules["kv_heads"] = None
    return rules


def check_mesh(
    cfg,
    spec: str | dict[str, int] | None,
    *,
    num_devices: int | None = None,
    max_num_seqs: int | None = None,
    num_pages: int | None = None,
) -> dict[str, int]:
    """Mesh axis sizes for `spec`; raises ValueError saying what to change when `cfg` (a
    `ModelConfig`) or the engine budgets cannot be split over it."""
    sizes = parse_mesh(spec)
    total = math.prod(sizes.values())
    if num_devices is not None and spec and total != num_devices:
        raise ValueError(
            f"mesh {spec!r} spans {total} devices but {num_devices} are available; make "
            f"the product of the axis sizes equal {num_devices}"
        )
    errors = []
    t = sizes[TENSOR]
    moe = is_moe(cfg)
    # The dense weights' shards: expert * tensor (see `dense_axes`).
    dense, where = (sizes[EXPERT] * t, "expert*tensor") if sizes[EXPERT] > 1 else (t, TENSOR)

    def divides(what: str, n: int, axis: str, size: int | None = None) -> None:
        size = sizes[axis] if size is None else size
        if n % size:
            ok = [d for d in range(1, n + 1) if n % d == 0 and d <= 64]
            errors.append(f"{what}={n} is not divisible by {axis}={size}; use {axis} in {ok}")

    if dense > 1:
        divides("num_heads", cfg.num_heads, where, dense)
        divides("vocab_size", cfg.vocab_size, where, dense)
        if not moe or not all(cfg.is_moe_layer(i) for i in range(cfg.num_layers)):
            divides("intermediate_size", cfg.intermediate_size, where, dense)
        if cfg.num_kv_heads % dense and dense % cfg.num_kv_heads:
            errors.append(
                f"num_kv_heads={cfg.num_kv_heads} and {where}={dense}: one must divide the "
                f"other (KV heads split over {where}, or each replicated "
                f"{where}/num_kv_heads times)"
            )
    if moe and t > 1:
        divides("moe_intermediate_size", cfg.moe_intermediate_size, TENSOR)
    shared = getattr(cfg, "num_shared_experts", 0) * getattr(cfg, "moe_intermediate_size", 0)
    if shared and dense > 1:  # DeepSeek's shared experts: one gated MLP split like a dense one
        divides("n_shared_experts*moe_intermediate_size", shared, where, dense)
    if sizes[PIPELINE] > 1 and getattr(cfg, "is_mla", False):
        errors.append(
            f"{cfg.model_type} runs no pipeline stages (its dense and MoE layers differ "
            f"in kind); use pipeline=1 with the data, expert and tensor axes"
        )
    elif sizes[PIPELINE] > 1:
        divides("num_layers", cfg.num_layers, PIPELINE)
    if sizes[EXPERT] > 1 and moe:
        divides("num_experts", cfg.num_experts, EXPERT)
    d = sizes[DATA]
    if d > 1:
        if max_num_seqs is not None and max_num_seqs % d:
            errors.append(
                f"max_num_seqs={max_num_seqs} is not divisible by data={d}; each replica "
                f"runs max_num_seqs/data sequences"
            )
        if num_pages is not None and (num_pages % d or num_pages // d < 2):
            errors.append(
                f"num_pages={num_pages} does not split into data={d} pools of >= 2 pages; "
                f"give a multiple of {d} of at least {2 * d}"
            )
    if errors:
        raise ValueError(f"mesh {spec!r} does not fit: " + "; ".join(errors))
    return sizes


def make_mesh(
    spec: str | dict[str, int] | None = None, devices: Sequence[jax.Device] | None = None
) -> Mesh:
    sizes = parse_mesh(spec)
    devices = list(devices if devices is not None else jax.devices())
    total = math.prod(sizes.values())
    if spec is None or not spec:
        devices = devices[:1]
    elif total != len(devices):
        raise ValueError(
            f"mesh {spec!r} has {total} devices but {len(devices)} are available; "
            f"make the product of the axis sizes equal {len(devices)}"
        )
    arr = np.array(devices[:total]).reshape([sizes[a] for a in MESH_AXES])
    return Mesh(arr, MESH_AXES)


def device_put_global(tree: Any, shardings: Any) -> Any:
    """`jax.device_put(tree, shardings)` for host data that every process holds in full.

    With several processes `jax.device_put` first checks, with a collective per leaf, that every
    process passed equal data; here each process slices its own copy instead (NOTE: the caller
    makes the copies equal: the multi-host step channel, or every process reading one checkpoint).
    """
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)
    if isinstance(shardings, jax.sharding.Sharding):
        shardings = jax.tree.map(lambda _: shardings, tree)

    def put(x: Any, sharding: jax.sharding.Sharding) -> jax.Array:
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

    return jax.tree.map(put, tree, shardings)


@dataclasses.dataclass(frozen=True)
class Parallel:
    """Mesh axis sizes as seen from inside `shard_map` (static, hashable).

    Model code holds local shards (e.g. `num_heads // tensor` heads) and calls `psum` where a
    Megatron-style split leaves partial sums.
    """

    data: int = 1
    pipeline: int = 1
    expert: int = 1
    tensor: int = 1

    @classmethod
    def from_mesh(cls, mesh: Mesh | None) -> Parallel:
        if mesh is None:
            return cls()
        shape = dict(mesh.shape)
        return cls(**{a: int(shape.get(a, 1)) for a in MESH_AXES})

    def size(self, axis: str) -> int:
        return getattr(self, axis)

    @property
    def is_single(self) -> bool:
        return all(getattr(self, a) == 1 for a in MESH_AXES)

    def psum(self, x: jax.Array, *axes: str) -> jax.Array:
        """Sums `x` over those of `axes` that are split (size > 1); identity otherwise."""
        split = tuple(a for a in axes if self.size(a) > 1)
        return jax.lax.psum(x, split) if split else x

    def index(self, axis: str) -> jax.Array | int:
        """This device's position on `axis` (0 when the axis is not split)."""
        return jax.lax.axis_index(axis) if self.size(axis) > 1 else jnp.int32(0)

    @property
    def dense(self) -> int:
        """Shards of the dense weights' split dims (heads, vocab, dense MLP): expert * tensor.

        NOTE: on a dense model the expert axis splits these like tensor does (`dense_axes`).
        """
        return self.expert * self.tensor

    def dense_index(self) -> jax.Array | int:
        """This device's position among the `dense` shards, expert-major as in a `DENSE` spec."""
        return self.index(EXPERT) * self.tensor + self.index(TENSOR)
