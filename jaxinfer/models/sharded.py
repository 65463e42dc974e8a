"""The one sharded-forward wrapper every family's `forward` runs through.

1. `forward(local, specs_of, cache_specs_of, params, cfg, step, kv_caches, ...)` resolves the
   kernels (`Kernels`) and the mesh's axis sizes (`sharding.Parallel`). On one device it calls
   `local(params, cfg, step, kv_caches, kernels, par)` directly.
2. On a mesh it runs that same `local` inside one `shard_map` (manual SPMD): the params' specs
   from the family's `param_specs` (plus any LoRA stacks', `lora.device.attach_specs`) through
   the sharding rules (`sharding.model_rules`), stacked by stage on a pipeline mesh
   (`pipeline.stack_stages`; the caches get a leading stage dim), each
   layer's cache spec from the family's `kv_cache_specs`, the step replicated or split over `data`
   (a leading `[data]` dim, one ragged step per replica), logits sharded on vocab over the dense
   axes (`sharding.dense_axes`). `local` adds the collectives (`Parallel.psum`) itself and
   dispatches to its pipelined loop when `par.pipeline > 1`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
from jax.sharding import Mesh, PartitionSpec

from jaxinfer import layers
from jaxinfer import pipeline as pipeline_lib
from jaxinfer.config import ModelConfig
from jaxinfer.lora import device as lora_device
from jaxinfer.params import partition_specs
from jaxinfer.quantization import quantization_of
from jaxinfer.sharding import DATA, PIPELINE, Parallel, dense_axes, model_rules
from jaxinfer.step import StepInputs

SINGLE = Parallel()  # one device: every axis size 1


class Kernels(NamedTuple):
    """The resolved (concrete) backends a forward pass uses: static, part of the compiled program."""

    attention: str = "reference"  # see jaxinfer.attention
    linear: str = "xla"  # see jaxinfer.layers.resolve_linear_backend


# (params, cfg, step, kv_caches, kernels, par) -> (logits [N, V/dense], kv_caches), on local shards
LocalForward = Callable[..., tuple[jax.Array, tuple[Any, ...]]]


def forward(
    local: LocalForward,
    specs_of: Callable[..., Any],
    cache_specs_of: Callable[[ModelConfig, Parallel, Any], Any],
    params: Any,
    cfg: ModelConfig,
    step: StepInputs,
    kv_caches: tuple[Any, ...],
    *,
    attention_backend: str,
    linear_backend: str,
    mesh: Mesh | None,
) -> tuple[jax.Array, tuple[Any, ...]]:
    """`local` over the whole model (one device) or inside one `shard_map` over `mesh`.

    `specs_of(cfg, quantization=...)` is the family's `param_specs`, `cache_specs_of(cfg, par,
    cache)` its `kv_cache_specs`. Returns (logits f32[N, V] (`[data, N, V]` with data replicas)
    sharded on vocab, the updated caches).
    """
    par = Parallel.from_mesh(mesh)
    kernels = Kernels(attention_backend, layers.resolve_linear_backend(linear_backend))
    if par.is_single:
        return local(params, cfg, step, kv_caches, kernels, SINGLE)
    specs = lora_device.attach_specs(specs_of(cfg, quantization=quantization_of(params)), params)
    if par.pipeline > 1:  # layers stacked by stage, caches per stage position [S, data*P, ...]
        specs = pipeline_lib.stack_stages(specs, par.pipeline)
    param_specs = partition_specs(specs, model_rules(cfg, par))
    stacked = par.data > 1
    step_spec = PartitionSpec(DATA) if stacked else PartitionSpec()
    cache_spec = cache_specs_of(cfg, par, kv_caches[0], attention_backend)
    if par.pipeline > 1:
        cache_spec = PartitionSpec(PIPELINE, *cache_spec)
    cache_specs = tuple(cache_spec for _ in kv_caches)
    vocab = dense_axes(cfg, par)
    logits_spec = PartitionSpec(DATA, None, vocab) if stacked else PartitionSpec(None, vocab)

    def body(params, step, kv_caches):
        if stacked:
            step = jax.tree.map(lambda x: x[0], step)
        logits, caches = local(params, cfg, step, kv_caches, kernels, par)
        return (logits[None] if stacked else logits), caches

    # NOTE: check_vma off: the Pallas kernels inside carry no varying-axis annotations.
    run = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(param_specs, step_spec, cache_specs),
        out_specs=(logits_spec, cache_specs),
        check_vma=False,
    )
    return run(params, step, tuple(kv_caches))
