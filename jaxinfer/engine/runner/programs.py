"""The runner's device programs: one jitted step (pending tokens fed + forward + penalty-state
update + sampler + logprobs) and the sampler alone (split steps), plus how their host inputs
travel (`pack`: one buffer per dtype, `unpack_buffers` by static slices inside the program).

1. `step_program` runs a whole step over `StepInputs` + `BatchExtras` + `SamplingMetadata`,
   KV cache and `PenaltyState` donated; it returns (sampler output, prompt logprobs, the sampled
   rows' logits), the caches, the state and the sampled ids padded to a fixed `[R]` (the next
   program's `prev_tokens`).
2. `sample_program` is the sampler of a step launched with `defer_sampling`; `burst_program`
   runs several pure-decode steps in one device loop (multi-step scheduling, `advance`).
3. `step_jit` / `sampler_jit` / `burst_jit` are their jitted forms on one device (packed
   inputs) or a mesh, compiled with `compiler_options()` for the target platform: on a GPU every conditional and
   loop of the step runs inside XLA's command buffer (a CUDA graph), so one launch runs the step,
   and no Triton GEMM splits K (its reduction would be a launch before each Pallas consumer).
4. `bound(fn, ...)` is the function a step/sampler jit wraps: one object per (function, backends,
   mesh, target device) in the process, so the jit of a second runner with the same options finds
   the first one's traces, lowerings and compiled programs in JAX's in-memory caches (keyed by
   the function object; a new `functools.partial` per runner re-traced, re-lowered and read the
   persistent cache again: ~1.7 s of CPU per tiny engine). On one device the runners share the
   `jax.jit` object too (`_jit`): a `ProgramTable` lowers a shape its jit ran twice (to call it
   directly, `direct_call`), which traces nothing on the jit object that ran it but traced again
   on another runner's own jit of the same function. The caches behind a jit are shared, so a
   runner counts the programs its own calls used by call signature
   (`ProgramTable.jit_cache_size`), not `_cache_size()`.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxinfer.config import ModelConfig
from jaxinfer.models import family_of
from jaxinfer.sampling import SamplerOutput, SamplingMetadata, compute_logprobs, sample
from jaxinfer.sampling_params import MAX_LOGPROBS
from jaxinfer.step import StepInputs
from pallas_kernels import target


@struct.dataclass
class BatchExtras:
    """Per-step inputs beyond the model's: penalty bookkeeping and prompt-logprob targets."""

    token_seq: (
        jax.Array
    )  # i32[T] index of each token's sequence in this step (padding -> S, dropped)
    token_is_output: jax.Array  # bool[T] token sits past its request's prompt
    seq_rows: jax.Array  # i32[S] penalty-state row of each sequence (padding -> the spare row)
    reset_rows: jax.Array  # bool[S] clear this sequence's row before counting (new owner)
    sample_rows: jax.Array  # i32[S] token row holding each sequence's last position
    target_ids: jax.Array  # i32[T] next prompt token per position (prompt-logprob programs only)
    feed_rows: jax.Array  # i32[T] row of prev_tokens that holds this (pending) token; -1: given
    # Verify rows of a speculative step (W = 0 otherwise); sample_rows then has S + W entries.
    spec_seq: jax.Array  # i32[W] result row (sequence) of each verify row (padding -> 0)
    spec_positions: jax.Array  # i32[W] position the verify row's sampled token takes
    # i32[S, ceil(V / 32)] structured output's allowed tokens (-1: all). None on the host when no
    # row is constrained: the runner then passes a device-resident all-ones array (no 1.5 MiB
    # fill, pack and transfer per 256-row step of a 49K vocabulary).
    token_bitmask: jax.Array | None
    # bool[1] `sampling.needs_staged` of the step's sampled rows, computed on the host
    # (`StepInputBuilder.with_staged`); None: the sampler computes it (~9 flag reductions on a GPU)
    sample_staged: jax.Array | None = None


@struct.dataclass
class PenaltyState:
    prompt_mask: jax.Array  # bool[R, V]
    output_counts: jax.Array  # i32[R, V]


def step_program(
    params,
    cfg: ModelConfig,
    kv_caches,
    state: PenaltyState,
    prev_tokens: jax.Array,
    step: StepInputs,
    extras: BatchExtras,
    meta: SamplingMetadata,
    *,
    all_logits: bool,
    attention_backend: str,
    linear_backend: str = "xla",
    mesh: Any = None,
):
    """Pending tokens fed + forward + penalty bookkeeping + sampling, as one program."""
    stacked = step.token_ids.ndim >= 2  # [data?, M?, T]: per replica / micro-batch
    token_ids = jnp.where(
        extras.feed_rows >= 0,
        prev_tokens[jnp.maximum(extras.feed_rows, 0)],
        step.token_ids.reshape(-1),
    )
    step = step.replace(token_ids=token_ids.reshape(step.token_ids.shape))
    with jax.named_scope("penalty_state"):
        # One gather of this step's rows, small scatters on them, one write back.
        fresh = extras.reset_rows[:, None]
        prompt_mask = jnp.where(fresh, False, state.prompt_mask[extras.seq_rows])  # bool[S, V]
        output_counts = jnp.where(fresh, 0, state.output_counts[extras.seq_rows])  # i32[S, V]
        prompt_mask = prompt_mask.at[extras.token_seq, token_ids].max(
            ~extras.token_is_output, mode="drop"
        )
        output_counts = output_counts.at[extras.token_seq, token_ids].add(
            extras.token_is_output.astype(jnp.int32), mode="drop"
        )
        state = PenaltyState(
            state.prompt_mask.at[extras.seq_rows].set(prompt_mask),
            state.output_counts.at[extras.seq_rows].set(output_counts),
        )
    logits, kv_caches = family_of(cfg).forward(
        params,
        cfg,
        step,
        kv_caches,
        attention_backend=attention_backend,
        linear_backend=linear_backend,
        mesh=mesh,
    )
    # NOTE: the penalty-state writes are done before the sampler's conditional: XLA scheduled them
    # after it, outside the step's first command buffer (two more host launches a GPU step).
    state, logits = jax.lax.optimization_barrier((state, logits))
    if stacked:
        logits = logits.reshape(-1, logits.shape[-1])  # [data * rows, V]
    with jax.named_scope("sampler"):
        row_logits = jnp.take(logits, extras.sample_rows, axis=0) if all_logits else logits
        # Each row's sampled token goes at position kv_len: its random counter (batch-invariant).
        positions = step.kv_lens.reshape(-1)  # i32[S]
        num_seqs = positions.shape[0]
        bitmask = extras.token_bitmask  # i32[S, ceil(V / 32)]
        if extras.spec_seq.shape[0]:  # verify rows: their sequence's penalty rows, own positions
            positions = jnp.concatenate([positions, extras.spec_positions])
            prompt_mask = jnp.concatenate([prompt_mask, prompt_mask[extras.spec_seq]])
            output_counts = jnp.concatenate([output_counts, output_counts[extras.spec_seq]])
            # NOTE: constrained requests never speculate: verify rows allow every token
            bitmask = jnp.concatenate(
                [bitmask, jnp.full((extras.spec_seq.shape[0], bitmask.shape[1]), -1, bitmask.dtype)]
            )
        out = sample(
            row_logits,
            meta,
            prompt_mask,
            output_counts,
            positions,
            num_logprobs=MAX_LOGPROBS,
            token_bitmask=bitmask,
            staged=extras.sample_staged,
        )
    prompt = compute_logprobs(logits, extras.target_ids, MAX_LOGPROBS) if all_logits else None
    next_tokens = jnp.zeros_like(prev_tokens).at[:num_seqs].set(out.token_ids[:num_seqs])
    return (out, prompt, row_logits), kv_caches, state, next_tokens


def burst_program(
    params,
    cfg: ModelConfig,
    kv_caches,
    state: PenaltyState,
    prev_tokens: jax.Array,
    step: StepInputs,
    extras: BatchExtras,
    meta: SamplingMetadata,
    num_steps: jax.Array,  # i32[1] how many steps to run, 1..max_steps
    *,
    max_steps: int,
    page_size: int,
    all_logits: bool = False,
    **backends,
):
    """`num_steps` decode steps of a pure-decode batch in one program (multi-step scheduling,
    `EngineConfig.num_scheduler_steps`), one `step_program` in a device loop: the first step on
    the host's inputs; each next one feeds every sequence the id it just sampled, one position
    further on (`advance`), with the same sampling rows, so each token is the one a step of its
    own would sample (the penalty state counts it, its random counter is its position). Returns
    every step's sampler output stacked (`SamplerOutput` of [max_steps, S, ...] arrays; steps
    past `num_steps` zero), the caches, the state and the last step's ids (the next program's
    `prev_tokens`). `all_logits` (part of a step call's key) must be False: a burst returns no
    prompt logprobs. On a mesh (`backends["mesh"]`) the inputs are the placed trees of one
    replica, no stages."""
    if all_logits:
        raise ValueError("a multi-step program computes no prompt logprobs")
    rows = step.kv_lens.size  # S sampled rows, one a sequence
    outs = SamplerOutput(
        token_ids=jnp.zeros((max_steps, rows), jnp.int32),
        logprobs=jnp.zeros((max_steps, rows), jnp.float32),
        topk_ids=jnp.zeros((max_steps, rows, MAX_LOGPROBS), jnp.int32),
        topk_logprobs=jnp.zeros((max_steps, rows, MAX_LOGPROBS), jnp.float32),
    )
    real = step.slot_mapping >= 0  # bool[T]: every real token is its sequence's one token

    def body(i, carry):
        kv_caches, state, prev_tokens, step, outs = carry
        first = i == 0  # the host's extras; then every real token is the id just sampled
        fed = extras.replace(
            feed_rows=jnp.where(first, extras.feed_rows, jnp.where(real, extras.token_seq, -1)),
            token_is_output=jnp.where(first, extras.token_is_output, real),
            reset_rows=extras.reset_rows & first,
        )
        (out, _, _), kv_caches, state, prev_tokens = step_program(
            params,
            cfg,
            kv_caches,
            state,
            prev_tokens,
            step,
            fed,
            meta,
            all_logits=False,
            **backends,
        )
        outs = jax.tree.map(lambda acc, x: acc.at[i].set(x), outs, out)
        return kv_caches, state, prev_tokens, advance(step, extras.token_seq, page_size), outs

    with jax.named_scope("burst"):
        kv_caches, state, prev_tokens, _, outs = jax.lax.fori_loop(
            0, num_steps[0], body, (kv_caches, state, prev_tokens, step, outs)
        )
    return outs, kv_caches, state, prev_tokens


def advance(step: StepInputs, token_seq: jax.Array, page_size: int) -> StepInputs:
    """A pure-decode step's inputs one token further on: each real token (slot >= 0) moves to
    the next position of its sequence (its K/V slot from the sequence's page table), each live
    sequence's `kv_lens` grows by one; padding stays padding."""
    real = step.slot_mapping >= 0
    positions = step.positions + real
    seqs = jnp.minimum(token_seq, step.page_indices.shape[0] - 1)
    page = step.page_indices[seqs, positions // page_size]
    slots = jnp.where(real, page * page_size + positions % page_size, -1)
    live = jnp.arange(step.kv_lens.shape[0]) < step.num_seqs[0]
    return step.replace(positions=positions, slot_mapping=slots, kv_lens=step.kv_lens + live)


def sample_program(
    state: PenaltyState, row_logits: jax.Array, inputs: dict, *, num_sample_rows: int
) -> tuple[SamplerOutput, jax.Array]:
    """The sampler of a step launched with `defer_sampling`, as its own program (one per
    sequence bucket: it does not depend on the token or page bucket).

    `row_logits` f32[S, V] and `state` come from that step's program; `inputs` holds the host
    arrays: `meta` (SamplingMetadata of S rows), `seq_rows` i32[S] (penalty-state row of each),
    `positions` i32[S] (where each sampled token goes) and `token_bitmask` i32[S, ceil(V / 32)].
    The state already counts the step's tokens, so its rows are the penalty rows the fused
    program samples with. Returns (sampler output, sampled ids padded to i32[num_sample_rows]:
    the next program's `prev_tokens`).
    """
    seq_rows = inputs["seq_rows"]
    with jax.named_scope("sampler"):
        out = sample(
            row_logits,
            inputs["meta"],
            state.prompt_mask[seq_rows],
            state.output_counts[seq_rows],
            inputs["positions"],
            num_logprobs=MAX_LOGPROBS,
            token_bitmask=inputs["token_bitmask"],
        )
    next_tokens = (
        jnp.zeros(num_sample_rows, jnp.int32).at[: out.token_ids.shape[0]].set(out.token_ids)
    )
    return out, next_tokens


def pack(inputs: dict) -> tuple[tuple[np.ndarray, ...], tuple]:
    """The step's host inputs as one flat buffer per dtype, plus the static layout that `unpack_buffers`
    `unpack_buffers` reverses inside the program: one device transfer of ~3 buffers instead of ~25 leaves (each
    leaf costs ~20 us of host time in `device_put`)."""
    leaves, treedef = jax.tree.flatten(inputs)
    leaves = [np.asarray(x) for x in leaves]
    groups: dict[str, list[int]] = {}
    for i, x in enumerate(leaves):
        groups.setdefault(x.dtype.str, []).append(i)
    buffers, spec = [], [None] * len(leaves)
    for b, (_, idx) in enumerate(sorted(groups.items())):
        offset = 0
        for i in idx:
            spec[i] = (b, offset, leaves[i].shape)
            offset += leaves[i].size
        buffers.append(np.concatenate([leaves[i].ravel() for i in idx]))
    return tuple(buffers), (treedef, tuple(spec))


def unpack_buffers(buffers: tuple[jax.Array, ...], layout: tuple) -> dict:
    treedef, spec = layout
    return jax.tree.unflatten(
        treedef, [buffers[b][o : o + math.prod(shape)].reshape(shape) for b, o, shape in spec]
    )


def packed_step_program(
    params,
    cfg: ModelConfig,
    kv_caches,
    state: PenaltyState,
    prev_tokens,
    buffers,
    token_bitmask,  # i32[S, ceil(V / 32)], passed apart from the packed buffers
    meta: SamplingMetadata,  # on the device, kept there while the rows are unchanged
    *,
    layout: tuple,
    all_logits: bool,
    **backends,
):
    inputs = _unpacked(buffers, token_bitmask, layout)
    step, extras = inputs["step"], inputs["extras"]
    return step_program(
        params,
        cfg,
        kv_caches,
        state,
        prev_tokens,
        step,
        extras,
        meta,
        all_logits=all_logits,
        **backends,
    )


def packed_burst_program(
    params,
    cfg: ModelConfig,
    kv_caches,
    state: PenaltyState,
    prev_tokens,
    buffers,
    token_bitmask,
    meta: SamplingMetadata,
    *,
    layout: tuple,
    all_logits: bool,
    **options,
):
    """`burst_program` over packed inputs (the step's, plus `num_steps`)."""
    inputs = _unpacked(buffers, token_bitmask, layout)
    step, extras, num_steps = inputs["step"], inputs["extras"], inputs["num_steps"]
    return burst_program(
        params,
        cfg,
        kv_caches,
        state,
        prev_tokens,
        step,
        extras,
        meta,
        num_steps,
        all_logits=all_logits,
        **options,
    )


def _unpacked(buffers, token_bitmask, layout: tuple) -> dict:
    """The host inputs of packed `buffers`, the bitmask (passed apart) put back in the extras."""
    inputs = unpack_buffers(buffers, layout)
    inputs["extras"] = inputs["extras"].replace(token_bitmask=token_bitmask)
    return inputs


def packed_sample_program(
    state: PenaltyState, row_logits: jax.Array, buffers, *, layout: tuple, num_sample_rows: int
) -> tuple[SamplerOutput, jax.Array]:
    return sample_program(
        state, row_logits, unpack_buffers(buffers, layout), num_sample_rows=num_sample_rows
    )


# XLA's default command-buffer kinds plus conditionals and loops. NOTE: outside a command buffer
# XLA:GPU runs a conditional (the sampler's greedy fast path) by copying its predicate to the host
# and waiting for it, so the call that launches a step returned only when the device had run the
# whole forward: the host's work for the next step never overlapped the device's (Llama-3-8B
# decode on an H200: 10.6 ms per step, 5.75 ms with this; BENCHMARKS.md, issue 31).
GPU_COMMAND_BUFFER = (
    "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,CONDITIONAL,WHILE"
)


# NOTE: no split-K Triton GEMMs on a GPU: the GEMMs feeding the Pallas kernels (QKV -> attention,
# o_proj and down -> the add + RMSNorm kernel) would each launch one more kernel to reduce their
# f32 partials, a reduction XLA otherwise fuses into the consumer (deviceless H100, Llama-3-8B
# decode layer: 12 -> 9 launches at one token; BENCHMARKS.md, issue 31)
GPU_FORCE_SPLIT_K = 1


def compiler_options() -> dict[str, str | int]:
    """XLA options the step programs compile with on the target platform (`target.platform()`);
    an option the caller's XLA_FLAGS names wins."""
    if target.platform() != "gpu":
        return {}
    flags = os.environ.get("XLA_FLAGS", "")
    options: dict[str, str | int] = {
        "xla_gpu_enable_command_buffer": GPU_COMMAND_BUFFER,
        "xla_gpu_experimental_force_split_k": GPU_FORCE_SPLIT_K,
    }
    return {k: v for k, v in options.items() if k not in flags}


def bound(fn: Any, shared: bool = True, **kwargs: Any) -> Any:
    """`functools.partial(fn, **kwargs)`, one object per keywords and target device
    (the module docstring, step 4); a new one when not `shared`.

    NOTE: what a step's trace reads beyond its arguments must be in this key or in the jit's own
    (its options, JAX's config): the backends, the mesh and the target device (kernel choices and
    interpret modes follow `target.platform()`). A test that patches a module constant read while
    tracing must `jax.clear_caches()`, as for any module-level jit."""
    if not shared:
        return functools.partial(fn, **kwargs)
    return _bound(fn, target.device(), tuple(sorted(kwargs.items())))


@functools.cache
def _bound(fn: Any, device: Any, kwargs: tuple) -> Any:
    return functools.partial(fn, **dict(kwargs))


def step_jit(
    attention_backend: str,
    linear_backend: str,
    mesh: Any = None,
    carried: Any = None,
    shared: bool = True,
) -> Any:
    """The jitted step: on one device over packed inputs (`packed_step_program`); on a mesh over
    the placed input tree, with what a step carries to the next (KV cache, penalty state,
    fed-back ids) left with the `carried` shardings it came in with. `shared`: over the process's
    one function object for these options (`bound`), else its own (programs compiled afresh)."""
    options = dict(attention_backend=attention_backend, linear_backend=linear_backend)
    return _program_jit(packed_step_program, step_program, options, mesh, carried, shared)


def burst_jit(
    attention_backend: str,
    linear_backend: str,
    max_steps: int,
    page_size: int,
    mesh: Any = None,
    carried: Any = None,
    shared: bool = True,
) -> Any:
    """The jitted multi-step program (`burst_program`), as `step_jit` (on a mesh: one replica,
    no stages)."""
    options = dict(
        attention_backend=attention_backend,
        linear_backend=linear_backend,
        max_steps=max_steps,
        page_size=page_size,
    )
    return _program_jit(packed_burst_program, burst_program, options, mesh, carried, shared)


def _program_jit(
    packed: Any, program: Any, options: dict, mesh: Any, carried: Any, shared: bool
) -> Any:
    """`packed(**options)` jitted on one device (inputs packed into one buffer per dtype, see
    `pack`), or `program(mesh=mesh, **options)` over placed trees on a mesh; KV caches and
    penalty state donated."""
    if mesh is None:
        return _jit(
            bound(packed, shared, **options),
            shared,
            static_argnames=("cfg", "all_logits", "layout"),
            donate_argnames=("kv_caches", "state"),
        )
    # NOTE: with the partitioner's choice instead, the first call's outputs would give the
    # second call other input shardings (a recompile of every program warmup built, on the first
    # real request).
    return jax.jit(
        bound(program, shared, mesh=mesh, **options),
        static_argnames=("cfg", "all_logits"),
        donate_argnames=("kv_caches", "state"),
        out_shardings=(None, *carried),
        compiler_options=compiler_options(),
    )


def burst_context(
    attention_backend: str,
    linear_backend: str,
    max_steps: int,
    page_size: int,
    mesh: Any = None,
    carried: Any = None,
) -> str:
    """`burst_jit`'s options, as `step_context`."""
    devices = None if mesh is None else mesh.device_ids.tolist()
    return (
        f"burst_program attention={attention_backend} linear={linear_backend} "
        f"max_steps={max_steps} page_size={page_size} mesh={mesh!r} devices={devices} "
        f"out_shardings={carried!r} donate=kv_caches,state static=cfg,all_logits,layout "
        f"compiler_options={sorted(compiler_options().items())}"
    )


def step_context(
    attention_backend: str, linear_backend: str, mesh: Any = None, carried: Any = None
) -> str:
    """What `step_jit` builds its program with beyond the arguments (a part of its key in the
    executable cache, `jaxinfer.executable_cache`). NOTE: name every option `step_jit` passes."""
    devices = None if mesh is None else mesh.device_ids.tolist()
    return (
        f"step_program attention={attention_backend} linear={linear_backend} mesh={mesh!r} "
        f"devices={devices} out_shardings={carried!r} donate=kv_caches,state "
        f"static=cfg,all_logits,layout compiler_options={sorted(compiler_options().items())}"
    )


def sampler_context(num_sample_rows: int) -> str:
    """`sampler_jit`'s options, as `step_context`."""
    return (
        f"sample_program num_sample_rows={num_sample_rows} static=layout "
        f"compiler_options={sorted(compiler_options().items())}"
    )


def sampler_jit(num_sample_rows: int, shared: bool = True) -> Any:
    """The jitted sampler of split steps (packed inputs, one device); `shared` as `step_jit`."""
    return _jit(
        bound(packed_sample_program, shared, num_sample_rows=num_sample_rows),
        shared,
        static_argnames=("layout",),
    )


_JITS: dict[tuple, Any] = {}


def _jit(fn: Any, shared: bool, **options: Any) -> Any:
    """`jax.jit(fn, compiler_options=compiler_options(), **options)`: one jit object per `bound`
    function and options where `shared` (step 4)."""
    options["compiler_options"] = compiler_options()
    if not shared:
        return jax.jit(fn, **options)
    key = (
        fn,
        repr([(k, sorted(v.items()) if isinstance(v, dict) else v) for k, v in options.items()]),
    )
    jitted = _JITS.get(key)
    if jitted is None:
        jitted = _JITS[key] = jax.jit(fn, **options)
    return jitted
