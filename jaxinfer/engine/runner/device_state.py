"""What the runner keeps on its devices: params, KV caches, penalty rows and the fed-back ids.

1. One device (`mesh` None): everything is committed to the params' device (outputs of a call
   with a committed input are committed, so uncommitted initial caches would give the first
   compiled program a signature no later call has: a recompile after warmup).
2. A mesh: params and KV caches are placed by the sharding rules (`shd.model_rules`), the
   penalty rows split over the vocabulary like the logits they apply to; step inputs go on with
   `put` (replicated, the ragged step split over `data`).
3. Pipeline stages (`pipeline` > 1): layers stacked by stage (`jaxinfer.pipeline`).
4. `abstract=True` (`jaxinfer.aot`): nothing is allocated; every array above is the
   `jax.ShapeDtypeStruct` (with its sharding, on the target's devices) that step 1 or 2 would
   have placed, and the params come in as such structs. The runner can then only lower and
   compile its programs (`ModelRunner.lower`), for a device this machine does not have.

Penalty state: `prompt_mask bool[R, V]` and `output_counts i32[R, V]`, one row per running request
(R = max_num_seqs + 1, the last a spare that padding rows write into).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from jaxinfer import attention, pipeline
from jaxinfer import params as params_lib
from jaxinfer import sharding as shd
from jaxinfer.config import ModelConfig
from jaxinfer.engine.runner.programs import PenaltyState
from jaxinfer.models import family_of
from jaxinfer.params import DTYPES
from jaxinfer.quantization import quantization_of


class DeviceState:
    """The runner's device arrays and their placement (see the module docstring)."""

    def __init__(
        self,
        cfg: ModelConfig,
        params: Any,
        *,
        mesh: Any,  # None: one device
        par: shd.Parallel,
        num_pages: int,
        page_size: int,
        max_num_seqs: int,
        num_sample_rows: int,
        dtype: str,
        kv_cache_dtype: str,
        attention_backend: str | None,
        abstract: bool = False,
    ) -> None:
        self.mesh = mesh
        self.abstract = abstract
        family = family_of(cfg)
        shape = family.kv_cache_shape(cfg, attention_backend, num_pages, page_size, par)
        family.check_kv_cache_dtype(
            cfg, attention.resolve_backend(attention_backend), kv_cache_dtype
        )
        if kv_cache_dtype == "fp8" and par.pipeline > 1:
            raise ValueError("kv_cache_dtype='fp8' is not supported with a pipeline mesh axis > 1")

        def new_caches():
            return tuple(
                attention.new_kv_cache(shape, DTYPES[dtype], kv_cache_dtype, attention_backend)
                for _ in range(cfg.num_layers)
            )

        rows = max_num_seqs + 1  # the last row is a spare that padding writes into
        zeros = functools.partial(jnp.zeros, num_sample_rows, jnp.int32)

        def new_state():
            return PenaltyState(
                jnp.zeros((rows, cfg.vocab_size), bool),
                jnp.zeros((rows, cfg.vocab_size), jnp.int32),
            )

        if mesh is None:
            device = self.device = _device_of(params)
            self.params = self.to_device(params)
            self.kv_caches = self._made(new_caches, device)
            self.state = self._made(new_state, device)
            self.prev_tokens = self._made(zeros, device)  # i32[num_sample_rows]
            return
        if par.pipeline > 1 and abstract:
            raise ValueError("an abstract device state (jaxinfer.aot) has no pipeline stages")
        rules = shd.model_rules(cfg, par)
        specs = family.param_specs(cfg, quantization=quantization_of(params))
        if par.pipeline > 1:  # layers stacked by stage (see jaxinfer.pipeline)
            self.params = pipeline.place_params(params, specs, mesh, rules)
        else:
            self.params = self._placed(  # a no-op for params the loader already placed
                params, params_lib.shardings(specs, mesh, rules)
            )
        cache_sharding = jax.tree.map(
            lambda spec: NamedSharding(mesh, spec),
            # NOTE: the structure only: new_caches() would build every layer's whole cache
            family.kv_cache_specs(cfg, par, jax.eval_shape(new_caches)[0], attention_backend),
        )
        self.replicated = NamedSharding(mesh, PartitionSpec())
        self.step_sharding = (
            NamedSharding(mesh, PartitionSpec(shd.DATA)) if par.data > 1 else self.replicated
        )
        self.kv_caches = (
            self._made(new_caches, (cache_sharding,) * cfg.num_layers)
            if par.pipeline == 1
            else pipeline.stage_kv_caches(
                cfg.num_layers,
                par.pipeline,
                shape,
                DTYPES[dtype],
                mesh,
                family.kv_cache_spec(cfg, par, attention_backend),
            )
        )
        # the penalty rows split over the vocabulary like the logits they are applied to
        self.state = self._made(new_state, NamedSharding(mesh, PartitionSpec(None, rules["vocab"])))
        self.prev_tokens = self._made(zeros, self.replicated)

    def _made(self, make: Any, shardings: Any) -> Any:
        """`make()`'s arrays on a device or created with `shardings` (a sharding tree); with
        `abstract` their shapes only."""
        if self.abstract:
            if isinstance(shardings, jax.Device):
                shardings = SingleDeviceSharding(shardings)
            return _structs(jax.eval_shape(make), shardings)
        if isinstance(shardings, jax.Device):
            return jax.device_put(make(), shardings)
        return jax.jit(make, out_shardings=shardings)()

    def _placed(self, tree: Any, shardings: Any) -> Any:
        """`jax.device_put(tree, shardings)`; with `abstract` the structs it would give."""
        if self.abstract:
            return _structs(tree, shardings)
        return jax.device_put(tree, shardings)

    def place(self, tree: Any, shardings: Any = None) -> Any:
        """`tree` onto the one device (`shardings` None) or `shardings`; with `abstract` its
        structs."""
        return self.to_device(tree) if shardings is None else self._placed(tree, shardings)

    def to_device(self, tree: Any) -> Any:
        """A tree onto the one device (`mesh` None), committed; with `abstract` its structs."""
        return self._placed(tree, SingleDeviceSharding(self.device))

    def carried(self) -> Any:
        """Shardings of what a step carries to the next: (KV caches, penalty state, ids)."""
        return jax.tree.map(lambda x: x.sharding, (self.kv_caches, self.state, self.prev_tokens))

    @property
    def kv_cache_bytes(self) -> int:
        return sum(c.size * c.dtype.itemsize for c in jax.tree.leaves(self.kv_caches))

    def bytes_per_device(self) -> dict[str, int]:
        """Parameter and KV-cache bytes held by the first device."""
        dev = jax.devices()[0] if self.mesh is None else self.mesh.devices.flat[0]

        def held(tree: Any) -> int:
            return sum(
                params_lib.array_bytes(s.data.shape, s.data.dtype)
                for x in jax.tree.leaves(tree)
                for s in x.addressable_shards
                if s.device == dev
            )

        return {"params": held(self.params), "kv_cache": held(self.kv_caches)}

    def put(self, inputs: dict) -> dict:
        """A step's host input tree onto the mesh (the ragged step split over `data`)."""
        shardings = jax.tree.map(lambda _: self.replicated, inputs)
        shardings["step"] = jax.tree.map(lambda _: self.step_sharding, inputs["step"])
        if self.abstract:
            return _structs(inputs, shardings)
        return shd.device_put_global(inputs, shardings)  # jax.device_put on one process


def _structs(tree: Any, shardings: Any) -> Any:
    """`jax.ShapeDtypeStruct`s of `tree`'s leaves with `shardings` (one sharding or a tree)."""
    if isinstance(shardings, jax.sharding.Sharding):
        shardings = jax.tree.map(lambda _: shardings, tree)
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=s), tree, shardings
    )


def _device_of(params: Any) -> jax.Device:
    """The device the (single-device) params live on; the default device for host arrays."""
    for leaf in jax.tree.leaves(params):
        if isinstance(leaf, jax.Array):
            return next(iter(leaf.devices()))
        if isinstance(leaf, jax.ShapeDtypeStruct) and leaf.sharding is not None:
            return next(iter(leaf.sharding.device_set))
    return jax.devices()[0]
