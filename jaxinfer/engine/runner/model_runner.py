"""`ModelRunner`: the runner's rooms composed - the persistent input batch, the step-input
builder, the bucket plan, the device state and the jitted programs - behind the `Runner`
interface the engine core drives (`execute`, or `launch` / `sample` / `collect`, and `warmup`).
See `jaxinfer.engine.runner` for the flow of a step.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import jax
import numpy as np

from jaxinfer import attention, executable_cache, layers, quantization
from jaxinfer import params as params_lib
from jaxinfer import sharding as shd
from jaxinfer.config import ModelConfig
from jaxinfer.engine import multihost
from jaxinfer.engine.runner.buckets import Buckets
from jaxinfer.engine.runner.device_state import DeviceState
from jaxinfer.engine.runner.input_batch import InputBatch
from jaxinfer.engine.runner.outputs import fetch_results, unpack_results
from jaxinfer.engine.runner.program_table import ProgramTable
from jaxinfer.engine.runner.programs import (
    burst_context,
    burst_jit,
    pack,
    sampler_context,
    sampler_jit,
    step_context,
    step_jit,
)
from jaxinfer.engine.runner.step_inputs import Prepared, StepInputBuilder, UnpackPlan
from jaxinfer.engine.runner.warmup import build as build_programs
from jaxinfer.engine.types import Launched, RunnerOutput, SchedulerOutput
from jaxinfer.lora import device as lora_device
from jaxinfer.lora.manager import LoRAManager
from jaxinfer.params import DTYPES
from jaxinfer.sampling import SamplerOutput, SamplingMetadata
from jaxinfer.structured import bitmask_width
from jaxinfer.vision.embeds import ImageEmbeds

logger = logging.getLogger(__name__)


class ModelRunner:
    """Owns the device state (params, KV cache, penalty rows) and runs one step per call."""

    synchronous_only = False  # `launch` / `collect` work (see `multihost.LeaderRunner`)

    def __init__(
        self,
        cfg: ModelConfig,
        params: Any,
        *,
        page_size: int,
        num_pages: int,
        max_model_len: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        dtype: str = "float32",
        attention_backend: str | None = None,
        linear_backend: str | None = None,
        token_buckets: tuple[int, ...] | None = None,
        page_buckets: tuple[int, ...] | None = None,
        mesh: Any = None,
        num_speculative_tokens: int = 0,
        spec_max_seqs: int = 0,
        kv_cache_dtype: str = "auto",
        abstract: bool = False,
        lora: tuple[int, int, int | None] | None = None,
        vision: Any = None,
        num_scheduler_steps: int = 1,
    ) -> None:
        """`num_pages` and `max_num_seqs` are totals over the data replicas (each gets 1/data);
        `page_buckets` are the widths of `page_indices` (default `default_page_buckets`);
        `num_speculative_tokens` K and `spec_max_seqs` size the verify-row buckets (K, 2K, 4K..
        up to K x spec_max_seqs) that `warmup` compiles; `kv_cache_dtype="fp8"` stores the cache
        as `reference.Fp8KVCache` (see jaxinfer.attention). `abstract=True` allocates nothing:
        `params` are `jax.ShapeDtypeStruct`s placed on a target's devices (`jaxinfer.aot`), and
        the runner only lowers its programs (`lower`), e.g. for a device this machine lacks.
        `lora` (max_loras, max_lora_rank, max_cpu_loras) turns multi-LoRA on (`jaxinfer.lora`).
        `vision` (a `jaxinfer.vision.encoder.ImageEncoder`) lets requests carry images.
        `num_scheduler_steps` > 1: pure-decode steps may run that many steps in one program
        (`SchedulerOutput.num_steps`; one data replica, no stages, no speculative decoding)."""
        par = shd.Parallel.from_mesh(mesh)
        self.mesh = None if par.is_single else mesh  # NOTE: one device keeps the plain program
        self.data = par.data
        self.microbatches = par.pipeline  # NOTE: M = S micro-batches keep every stage busy
        self.cfg = cfg
        self.page_size, self.num_pages = page_size, num_pages
        self.max_model_len, self.max_num_seqs = max_model_len, max_num_seqs
        self.pages_per_seq = math.ceil(max_model_len / page_size)
        if num_speculative_tokens and (self.data > 1 or self.microbatches > 1):
            raise ValueError(
                f"speculative decoding needs one data replica and no pipeline "
                f"stages (mesh data={self.data}, pipeline={self.microbatches})"
            )
        if num_scheduler_steps > 1 and (par.data > 1 or par.pipeline > 1 or num_speculative_tokens):
            raise ValueError(
                f"num_scheduler_steps={num_scheduler_steps} needs one data replica, no pipeline "
                f"stages and no speculative decoding (data={par.data}, pipeline={par.pipeline}, "
                f"num_speculative_tokens={num_speculative_tokens})"
            )
        if vision is not None and (self.data > 1 or self.microbatches > 1):
            raise ValueError("images need one data replica and no pipeline stages")
        self.images = None if vision is None else ImageEmbeds(vision)
        self.mrope = getattr(vision, "mrope", None)  # M-RoPE rows (`jaxinfer.vision.mrope`)
        if self.data > 1 and (num_pages % self.data or max_num_seqs % self.data):
            raise ValueError(
                f"num_pages={num_pages} and max_num_seqs={max_num_seqs} must be "
                f"multiples of data={self.data} (each replica gets an equal share)"
            )
        self.buckets = Buckets(
            max_num_batched_tokens=max_num_batched_tokens,
            pages_per_seq=self.pages_per_seq,
            seqs_per_replica=max_num_seqs // self.data,
            token_buckets=token_buckets,
            page_buckets=page_buckets,
            pipeline=par.pipeline,
            num_speculative_tokens=num_speculative_tokens,
            spec_max_seqs=spec_max_seqs,
        )
        # Sampled-id rows of the largest program (every program pads its ids to this many).
        self.num_sample_rows = (
            self.data * self.microbatches * self.buckets.seq_bucket(self.token_buckets[-1])
        )
        self.kv_cache_dtype = kv_cache_dtype
        self.linear_backend = layers.resolve_linear_backend(linear_backend)
        if self.linear_backend == "cpu" and par.is_single and not abstract:
            params = quantization.tile_for_cpu(params)  # int4 codes in the kernel's tiles
        self.device_state = DeviceState(
            cfg,
            params,
            mesh=self.mesh,
            par=par,
            num_pages=num_pages,
            page_size=page_size,
            max_num_seqs=max_num_seqs,
            num_sample_rows=self.num_sample_rows,
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
            attention_backend=attention_backend,
            abstract=abstract,
        )
        self.bitmask_width = bitmask_width(cfg.vocab_size)
        # The persistent input batch: row r of every array belongs to the request in batch.rows
        # with value r (the same row as its penalty state); row max_num_seqs is the padding spare.
        self.lora = self._lora_manager(lora, dtype) if lora is not None else None
        self.batch = InputBatch(max_num_seqs, self.pages_per_seq, lora is not None)
        self.inputs = StepInputBuilder(
            self.batch,
            self.buckets,
            page_size=page_size,
            data=self.data,
            microbatches=self.microbatches,
            bitmask_width=self.bitmask_width,
            decode_only=attention.resolve_backend(attention_backend) == "gpu",
        )
        self._all_allowed: dict[int, jax.Array] = {}  # rows -> i32[rows, W] of -1 on the device
        self.attention_backend = attention.resolve_backend(attention_backend)
        carried = None if self.mesh is None else self.device_state.carried()
        backends = (self.attention_backend, self.linear_backend, self.mesh, carried)
        # The step programs warmup built, by `_call_key` (cfg: the static positional argument)
        self._steps = ProgramTable.of(
            step_jit, step_context, "step", backends, static_argnums=(1,), fixed=4
        )
        self._jit = self._steps.jitted
        # Steps sampling structured-output rows run the step program up to the rows' logits,
        # then this one (see `sample`); single device only (on a mesh they sample in the step).
        self.split_sampling = self.mesh is None
        rows = self.num_sample_rows
        self._samplers = ProgramTable.of(sampler_jit, sampler_context, "sampler", (rows,), fixed=1)
        self._sample_jit = self._samplers.jitted
        # Multi-step programs (`burst_program`), one per pure-decode bucket, keyed as the steps
        self.num_scheduler_steps = num_scheduler_steps
        self._bursts: ProgramTable | None = None
        if num_scheduler_steps > 1:
            options = (
                self.attention_backend,
                self.linear_backend,
                num_scheduler_steps,
                page_size,
                self.mesh,
                carried,
            )
            self._bursts = ProgramTable.of(
                burst_jit, burst_context, "burst", options, static_argnums=(1,), fixed=4
            )
        self._steps.first_use = self._samplers.first_use = executable_cache.first_use_cache()
        if self._bursts is not None:
            self._bursts.first_use = self._steps.first_use
        self.num_compiled = 0
        # (token bucket, page bucket, logits, verify rows)
        self._compiled: set[tuple[int, int, bool, int]] = set()
        self._compiled_samplers: set[int] = set()  # sampled rows of each sampler program
        # id(host meta) -> (that meta, its device copy): see `_meta_on_device`
        self._device_metas: dict[int, tuple[SamplingMetadata, SamplingMetadata]] = {}

    @property
    def params(self) -> Any:
        return self.device_state.params

    @params.setter
    def params(self, params: Any) -> None:
        self.device_state.params = params

    @property
    def kv_caches(self) -> Any:
        return self.device_state.kv_caches

    @property
    def kv_cache_bytes(self) -> int:
        return self.device_state.kv_cache_bytes

    def bytes_per_device(self) -> dict[str, int]:
        """Parameter and KV-cache bytes held by the first device."""
        return self.device_state.bytes_per_device()

    @property
    def token_buckets(self) -> tuple[int, ...]:
        return self.buckets.token_buckets

    @property
    def page_buckets(self) -> tuple[int, ...]:
        return self.buckets.page_buckets

    def _lora_manager(self, lora: tuple[int, int, int | None], dtype: str) -> LoRAManager | None:
        """The LoRA room, its (empty) stacks attached to the params: refused by name where the
        model or the mesh cannot take it. Abstract (`jaxinfer.aot`): the stacks' structs only."""
        if self.data > 1 or self.microbatches > 1:
            raise ValueError(
                f"enable_lora: not supported with a data or pipeline mesh axis > 1 (data="
                f"{self.data}, pipeline={self.microbatches}); use tensor (or expert) parallelism"
            )
        layer = self.params.layers[0]
        if not hasattr(layer, "lora") or any(
            self.cfg.is_moe_layer(i) for i in range(self.cfg.num_layers)
        ):
            raise ValueError(f"enable_lora: not supported for model_type {self.cfg.model_type!r}")
        mesh, rules = self.mesh, shd.model_rules(self.cfg, shd.Parallel.from_mesh(self.mesh))

        def shardings(stacks: tuple) -> Any:  # split as the base weights are (`lora.device.AXES`)
            return params_lib.shardings(lora_device.stack_specs(stacks), mesh, rules)

        if self.device_state.abstract:
            n, r, _ = lora
            stacks = jax.eval_shape(lambda: lora_device.empty_stacks(self.cfg, n, r, DTYPES[dtype]))
            placed = self.device_state.place(stacks, None if mesh is None else shardings(stacks))
            self.params = lora_device.attach(self.params, placed)
            return None
        manager = LoRAManager(
            self.cfg, *lora, dtype=DTYPES[dtype], shardings=None if mesh is None else shardings
        )
        self.params = lora_device.attach(self.params, manager.stacks)
        return manager

    def prepare(self, sched: SchedulerOutput) -> Prepared | None:
        """Host half of a step (`StepInputBuilder.prepare`): numpy inputs (None: nothing to run).
        Adapters the schedule assigned to slots are written to the device first (`lora_loads`);
        unloaded ones leave the host cache (`lora_removes`).

        NOTE: apart from its unpacking plan (which stays on this process) the result is plain numpy
        plus Python scalars, so a multi-host driver can build it on one process and broadcast it;
        `run` on every process then does the device half.
        """
        if sched.lora_removes:
            self.lora.remove(sched.lora_removes)
        if sched.lora_loads:
            self.params = lora_device.attach(self.params, self.lora.load(sched.lora_loads))
        prepared = self.inputs.prepare(sched)
        if self.images is not None:
            self.images.release(sched.finished)
            if self.mrope is not None:
                self.mrope.release(sched.finished)
            if prepared is not None:
                step = self.images.place(sched.scheduled, prepared.inputs["step"])
                if self.mrope is not None:
                    step = self.mrope.place(sched.scheduled, step)
                prepared.inputs["step"] = step
        return prepared

    def unpack(
        self, plan: UnpackPlan, token_ids: np.ndarray, out: Any, prompt: Any
    ) -> RunnerOutput:
        """Fetched results -> `RunnerOutput` (`outputs.unpack_results`)."""
        return unpack_results(plan, token_ids, out, prompt)

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        prepared = self.prepare(sched)
        if prepared is None:
            return RunnerOutput(sampled_token_ids={})
        return self.unpack(prepared.plan, *self.run(prepared))

    def launch(self, sched: SchedulerOutput, *, defer_sampling: bool = False) -> Launched | None:
        """`execute` without waiting: the step is on the device when this returns (None: nothing
        was scheduled). Single-process only (a multi-host leader broadcasts `run`).

        With `defer_sampling` (needs `split_sampling`, no speculative tokens) the program keeps
        the sampled rows' logits instead of sampling them: the caller then fills
        `sched.token_bitmask` while the device runs it, and `sample(launched)` launches the
        sampler.
        """
        prepared = self.prepare(sched)
        if prepared is None:
            return None
        if not defer_sampling:
            results = self._results(prepared)
            self._note_compiled(prepared)
            return Launched(sched, results, prepared.plan)
        inputs = prepared.inputs
        if not self.split_sampling or prepared.spec_width or prepared.num_steps > 1:
            raise RuntimeError(
                "defer_sampling needs one device, one step and no speculative tokens"
            )
        # NOTE: the step program's own sampler then runs on padding rows (greedy, nothing
        # else: ~15 ms of a ~300 ms 64-row decode step on XLA:CPU), so no program is compiled
        # for it; skipping the sampler under a lax.cond instead measured every fused step
        # ~1.4x slower (416 vs 288 ms, separate runs at load 6-7: BENCHMARKS.md).
        inputs = {**inputs, "meta": self.inputs.padding_meta(len(inputs["extras"].seq_rows))}
        _, prompt, row_logits = self._call(inputs, prepared.all_logits)
        self._note_compiled(prepared)
        return Launched(sched, None, prepared.plan, deferred=(row_logits, prompt, prepared))

    def sample(self, launched: Launched) -> None:
        """Launches the sampler of a step launched with `defer_sampling`, under the bitmask rows
        of `launched.sched` (`bitmask_rows` / `token_bitmask`, filled since the launch); the
        sampled ids feed the next step as usual. `collect` then waits for it."""
        if launched.deferred is None:
            raise RuntimeError("sample() needs a step launched with defer_sampling")
        row_logits, prompt, prepared = launched.deferred
        launched.deferred = None
        bitmask = np.full((row_logits.shape[0], self.bitmask_width), -1, np.int32)
        self.inputs.place_bitmask(launched.sched, prepared.plan, bitmask)
        out = self._call_sampler(row_logits, prepared.inputs, bitmask)
        launched.results = self._wanted(prepared, (out, prompt))

    def _call_sampler(
        self,
        row_logits: jax.Array,  # f32[S, V] from the deferred step program
        inputs: dict,  # that step's host inputs
        bitmask: np.ndarray,  # i32[S, ceil(V / 32)]
    ) -> SamplerOutput:
        """Runs the sampler program of a deferred step (device results)."""
        host = {
            "meta": inputs["meta"],
            "seq_rows": inputs["extras"].seq_rows,
            "positions": inputs["step"].kv_lens.reshape(-1),
            "token_bitmask": bitmask,
        }
        buffers, layout = pack(host)  # NOTE: one transfer, as for the step program
        out, self.device_state.prev_tokens = self._samplers(
            layout, (self.device_state.state, row_logits, buffers), {"layout": layout}
        )
        if bitmask.shape[0] not in self._compiled_samplers:
            self._compiled_samplers.add(bitmask.shape[0])
            self.num_compiled = len(self._compiled) + len(self._compiled_samplers)
        return out

    def collect(self, launched: Launched) -> RunnerOutput:
        """Waits for a launched step and unpacks its results."""
        return self.unpack(launched.plan, *fetch_results(launched.results))

    def run(self, prepared: Prepared) -> tuple[Any, Any, Any]:
        """Device half: one transfer in, the jitted step, one transfer out of what the step needs:
        (sampled ids, sampler output or None, prompt logprobs or None) as numpy."""
        results = self._results(prepared)
        self._note_compiled(prepared)
        return multihost.device_get(results)  # NOTE: results may span other processes

    def _results(self, prepared: Prepared) -> tuple[Any, Any, Any]:
        """Runs the step's program: the device arrays the host will read (`_wanted`; a
        multi-step program's have a leading axis of its steps)."""
        if prepared.num_steps > 1:
            outs = self._call(prepared.inputs, False, prepared.num_steps)
            return outs.token_ids, outs if prepared.fetch_logprobs else None, None
        out, prompt, _ = self._call(prepared.inputs, prepared.all_logits)
        return self._wanted(prepared, (out, prompt))

    @staticmethod
    def _wanted(prepared: Prepared, results: tuple[Any, Any]) -> tuple[Any, Any, Any]:
        """Only the device arrays the host will read: no logprob arrays unless a row asked."""
        out, prompt = results
        return out.token_ids, out if prepared.fetch_logprobs else None, prompt

    def _note_compiled(self, prepared: Prepared) -> None:
        key = (prepared.bucket, prepared.page_bucket, prepared.all_logits, prepared.spec_width)
        if prepared.inputs["step"].decode_only:  # its own program (`StepInputs.decode_only`)
            key = (*key, True)
        if prepared.num_steps > 1:  # the bucket's multi-step program
            key = (*key, "burst")
        if key not in self._compiled:
            self._compiled.add(key)
            self.num_compiled = len(self._compiled) + len(self._compiled_samplers)

    def compiled_program_count(self) -> int:
        """Programs warmup built plus those in the step and sampler functions' own jit caches
        (a call of a shape warmup did not build, or a recompile, grows it)."""
        tables = (self._steps, self._samplers, *([self._bursts] if self._bursts else []))
        return sum(len(t) + t.jit_cache_size() for t in tables)

    def _call_key(self, args: tuple, kwargs: dict) -> Any:
        """What picks a step call's program in `_steps`: on one device its static arguments
        (the packed layout holds every input's shape); on a mesh the placed inputs' shapes."""
        if "layout" in kwargs:
            return kwargs["layout"], kwargs["all_logits"]
        leaves, tree = jax.tree.flatten(args[5:])
        return kwargs["all_logits"], tree, tuple(x.shape for x in leaves)

    def _args(self, inputs: dict, all_logits: bool, num_steps: int = 1) -> tuple[tuple, dict]:
        """The step program's arguments for host `inputs`, moved to the device in one transfer
        (with `num_steps` > 1 the multi-step program's: the count travels in the buffers)."""
        head = (
            self.device_state.params,
            self.cfg,
            self.device_state.kv_caches,
            self.device_state.state,
            self.device_state.prev_tokens,
        )
        extras = inputs["extras"]
        bitmask = extras.token_bitmask
        if self.mesh is None:
            # NOTE: numpy buffers go straight to the jitted call, whose C++ path moves them to
            # the device faster than a separate `jax.device_put` (~0.3 ms less per step).
            # (the bitmask is its own argument; a None leaf packs nothing)
            host = {
                "step": inputs["step"],
                "extras": extras if bitmask is None else extras.replace(token_bitmask=None),
            }
            if num_steps > 1:
                host["num_steps"] = np.array([num_steps], np.int32)
            buffers, layout = pack(host)
            rows = len(extras.seq_rows)
            if bitmask is None:
                bitmask = self._all_allowed.get(rows)
                if bitmask is None:
                    bitmask = self._all_allowed[rows] = self.device_state.to_device(
                        np.full((rows, self.bitmask_width), -1, np.int32)
                    )
            else:  # committed like the cached one: the same program either way
                bitmask = self.device_state.to_device(bitmask)
            if self.device_state.abstract:  # NOTE: host buffers would pick the default device
                buffers = self.device_state.to_device(buffers)
            return (*head, buffers, bitmask, self._meta_on_device(inputs["meta"])), {
                "layout": layout,
                "all_logits": all_logits,
            }
        if bitmask is None:
            inputs = {
                **inputs,
                "extras": extras.replace(
                    token_bitmask=np.full((len(extras.seq_rows), self.bitmask_width), -1, np.int32)
                ),
            }
        if num_steps > 1:
            inputs = {**inputs, "num_steps": np.array([num_steps], np.int32)}
        dev = self.device_state.put(inputs)
        steps = (dev["num_steps"],) if num_steps > 1 else ()
        return (*head, dev["step"], dev["extras"], dev["meta"], *steps), {"all_logits": all_logits}

    def _meta_on_device(self, meta: SamplingMetadata) -> SamplingMetadata:
        """`meta` moved to the device once: `StepInputBuilder.build` returns the same host object
        while the sampled rows and their parameters are unchanged (its meta cache), so a steady
        decode sends no sampling parameters at all. A few recent ones are kept (the padding rows' meta
        of split steps alternates with the real one)."""
        key = id(meta)
        hit = self._device_metas.get(key)
        if hit is not None and hit[0] is meta:
            return hit[1]
        dev = self.device_state.to_device(meta)
        if len(self._device_metas) >= 4:
            self._device_metas.pop(next(iter(self._device_metas)))
        self._device_metas[key] = (meta, dev)
        return dev

    def _call(self, inputs: dict, all_logits: bool, num_steps: int = 1) -> Any:
        """Runs the step program on host `inputs` (device results: sampler output, prompt
        logprobs, the sampled rows' logits), or with `num_steps` > 1 the multi-step program
        (every step's sampler output, stacked)."""
        args, kwargs = self._args(inputs, all_logits, num_steps)
        table = self._steps if num_steps == 1 else self._bursts
        (
            results,
            self.device_state.kv_caches,
            self.device_state.state,
            self.device_state.prev_tokens,
        ) = table(self._call_key(args, kwargs), args, kwargs)
        return results

    def lower(
        self,
        t_bucket: int,
        all_logits: bool = False,
        page_bucket: int | None = None,
        spec_width: int = 0,
        decode_only: bool = False,
        num_steps: int = 1,
    ) -> Any:
        """The bucket's step program, lowered (for HLO inspection, tests and `jaxinfer.aot`, with an
        `abstract` runner); the page bucket defaults to the largest; `decode_only`: the program of
        the bucket's pure-decode steps (`StepInputs.decode_only`); `num_steps` > 1: the bucket's
        multi-step program (`num_scheduler_steps`)."""
        p_bucket = page_bucket or self.pages_per_seq
        args, kwargs = self._args(
            self.inputs.idle_inputs(t_bucket, all_logits, p_bucket, spec_width, decode_only),
            all_logits,
            num_steps,
        )
        jitted = self._jit if num_steps == 1 else self._bursts.jitted
        return jitted.lower(*args, **kwargs)

    def warmup(self, *, structured: bool = False) -> int:
        """Compiles every program this runner's steps can take before the first request
        (`runner.warmup.build`); returns how many were built."""
        return build_programs(self, structured=structured)
