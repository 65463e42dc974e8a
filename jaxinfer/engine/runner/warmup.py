"""Warmup: every program a runner's steps can take, built before the first request.

1. `plan(runner)`: the (token bucket, page bucket, logits variant, verify rows, pure-decode)
   keys of `Buckets.warmup_plan()` plus, where the step-input builder marks pure-decode steps
   (the `gpu` attention backend), each bucket's pure-decode program.
2. `takes_burst(runner, key)`: whether a key is the program a pure-decode step of its bucket
   runs, so the bucket gets a multi-step program too (`num_scheduler_steps` > 1).
3. `build(runner, structured=)` builds them all (and with `structured` the sampler programs of
   split steps) through the runner's `ProgramTable`s: loaded from the executable cache or
   lowered here and compiled on `compile_threads()` threads (`ModelRunner.warmup`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from jaxinfer import compile_cache, executable_cache
from jaxinfer.engine.runner.programs import pack
from jaxinfer.engine.runner.step_inputs import Prepared
from jaxinfer.executable_cache import ExecutableCache

if TYPE_CHECKING:
    from jaxinfer.engine.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def build(runner: ModelRunner, *, structured: bool = False) -> int:
    """Compiles every (token bucket, page bucket, logits variant, verify rows) program, and
    with `structured` (and `split_sampling`) the sampler program of each sequence bucket that
    steps sampling structured-output rows run (`sample`); returns how many were built.

    NOTE: nothing runs. A program in the executable cache (`jaxinfer.executable_cache`,
    under the compilation cache directory) is loaded as it is on `compile_threads()`
    threads: nothing traced. Any other is lowered here (tracing holds the GIL), compiled on
    those threads (XLA compiles without it) and stored in the executable cache (JAX's
    persistent cache is paused meanwhile: `compile_cache.persistent_cache_paused`). The
    calls then run these `Compiled` programs themselves (`ProgramTable`), so the first step
    of a bucket compiles nothing (BENCHMARKS.md "Restarts").
    """
    start, loaded = time.perf_counter(), executable_cache.counts()["loaded"]
    cache = ExecutableCache.open()
    paused = compile_cache.persistent_cache_paused() if cache else contextlib.nullcontext()
    with paused, ThreadPoolExecutor(compile_threads(), thread_name_prefix="compile") as pool:
        built: dict[Any, Any] = {}  # plan key -> (future of its program, Lowered | None)
        for key in plan(runner):
            t_bucket, p_bucket, all_logits, width, decode = key
            inputs = runner.inputs.idle_inputs(t_bucket, all_logits, p_bucket, width, decode)
            args, kwargs = runner._args(inputs, all_logits)
            built[key] = runner._steps.build(
                runner._call_key(args, kwargs), args, kwargs, cache, pool
            )
            runner._note_compiled(
                Prepared(inputs, all_logits, t_bucket, p_bucket, False, spec_width=width)
            )
            if takes_burst(runner, key):
                args, kwargs = runner._args(inputs, False, runner.num_scheduler_steps)
                call_key = runner._call_key(args, kwargs)
                built[(*key, "burst")] = runner._bursts.build(call_key, args, kwargs, cache, pool)
                runner._note_compiled(
                    Prepared(inputs, False, t_bucket, p_bucket, False, num_steps=2)
                )
        if structured and runner.split_sampling:
            for t_bucket in runner.token_buckets:
                inputs = runner.inputs.idle_inputs(t_bucket, False, runner.page_buckets[0])
                rows = inputs["extras"].seq_rows.shape[0]
                if rows not in runner._compiled_samplers:
                    job, lowered = built[(t_bucket, runner.page_buckets[0], False, 0, False)]
                    step = lowered or job.result()
                    row_logits = step.out_info[0][2]  # (results, ...): its sampled rows' logits
                    args, layout = sampler_args(runner, inputs, row_logits)
                    sampler = runner._samplers.build(layout, args, {"layout": layout}, cache, pool)
                    built[("sampler", rows)] = sampler
                    runner._compiled_samplers.add(rows)
        runner.num_compiled = len(runner._compiled) + len(runner._compiled_samplers)
        for job, _ in built.values():
            job.result()
    logger.info(
        "warmup built %d programs in %.1fs (%d loaded from the executable cache %s)",
        runner.num_compiled,
        time.perf_counter() - start,
        executable_cache.counts()["loaded"] - loaded,
        cache.path if cache else "(off)",
    )
    return runner.num_compiled


def plan(runner: ModelRunner) -> Iterator[tuple[int, int, bool, int, bool]]:
    """`buckets.warmup_plan()` plus, where the builder marks pure-decode steps (the `gpu`
    attention backend), the pure-decode program of each bucket that can hold one (two tokens
    up to the bucket of one per sequence; a one-token step is always a decode)."""
    most = runner.buckets.decode_bucket
    for key in runner.buckets.warmup_plan():
        yield (*key, False)
        t_bucket, p_bucket, all_logits, width = key
        if (
            runner.inputs.decode_only
            and not all_logits
            and not width
            and 1 < t_bucket <= most
            and runner.data * runner.microbatches == 1
        ):
            yield t_bucket, p_bucket, False, 0, True


def takes_burst(runner: ModelRunner, key: tuple[int, int, bool, int, bool]) -> bool:
    """Whether warmup's plan `key` is the program a pure-decode step of its bucket runs, so
    the bucket gets a multi-step program too (`num_scheduler_steps` > 1)."""
    t_bucket, _, all_logits, width, decode = key
    return (
        runner._bursts is not None
        and not all_logits
        and not width
        and t_bucket <= runner.buckets.decode_bucket
        and decode == (runner.inputs.decode_only and t_bucket > 1)
    )


def sampler_args(runner: ModelRunner, inputs: dict, logits: Any) -> tuple[tuple, tuple]:
    """The sampler program's arguments (and packed layout) for a split step over host
    `inputs` (`_call_sampler`'s call), with the step program's row logits (`logits`: shape
    and dtype) as an abstract committed array."""
    rows = inputs["extras"].seq_rows.shape[0]
    state = runner.device_state.state
    sharding = jax.tree.leaves(state)[0].sharding
    row_logits = jax.ShapeDtypeStruct(logits.shape, logits.dtype, sharding=sharding)
    host = {
        "meta": inputs["meta"],
        "seq_rows": inputs["extras"].seq_rows,
        "positions": inputs["step"].kv_lens.reshape(-1),
        "token_bitmask": np.full((rows, runner.bitmask_width), -1, np.int32),
    }
    buffers, layout = pack(host)
    return (state, row_logits, buffers), layout


def compile_threads() -> int:
    """Threads that compile warmup's programs: the CPU cores (at most 8)."""
    return max(1, min(8, os.cpu_count() or 1))
