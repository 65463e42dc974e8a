"""ModelRunner: the only module that calls JAX on the hot path.

Flow of `execute(SchedulerOutput) -> RunnerOutput`:
  1. Patch the persistent input batch from the schedule's diffs: every running request owns a row
     (also its penalty-state row) of host numpy arrays - page table, prompt length, sampling
     columns (`SamplingRows`) - filled when it joins (`is_new`), extended by its new pages, dropped
     when it finishes or is preempted. Nothing is rebuilt per step from Python objects.
  2. Pick the smallest token bucket that holds the step's tokens (the sequence bucket follows
     from it) and the smallest page bucket that holds its longest page table, so the set of
     compiled programs is fixed and `warmup()` builds all of them; `page_indices` is
     `[S, page bucket]`, not `[S, max_model_len / page_size]`.
  3. Build every input with a handful of vectorized numpy gathers and scatters over the step's
     rows: the ragged `StepInputs`, the penalty bookkeeping and the sampling metadata (gathered
     again only when the step's rows or their parameters changed), and the structured-output
     token bitmask (all ones but the rows of constrained requests, which the engine core filled
     in `SchedulerOutput.token_bitmask`).
  4. One transfer of that tree (on one device packed into a numpy buffer per dtype that the jitted
     call moves itself, unpacked by static slices inside the program: `_pack`; on a mesh one
     sharded `device_put`), one jitted step (forward + penalty-state update + sampler + logprobs,
     KV cache and state donated), one `jax.device_get` of only what the step needs: the sampled
     ids, plus logprob arrays only when some row asked for them.
  5. Unpack into plain Python: sampled ids, logprobs, prompt logprobs per request.
`execute` does all five; `launch` (1-4 without waiting) + `collect` (wait, 5) let the engine
schedule and launch the next step while this one runs (async scheduling): a decode token that
the still-running step samples is then a `PENDING_TOKEN` on the host, and the program takes it
from the previous program's sampled ids on the device (`BatchExtras.feed_rows`; every program
returns its sampled ids padded to a fixed `[R]`, the next one's `prev_tokens` input).

Structured output splits a step in two (single device): `launch(sched, defer_sampling=True)`
runs the same step program (every step program also returns its sampled rows' logits) with
padding sampling rows (greedy only: no extra program per bucket); while it runs the engine core
fills the grammar masks, and `sample(launched)` runs the sampler program (`_sample_step`: one
per sequence bucket, compiled by `warmup(structured=True)`) on those logits, the penalty rows
of the state the step left, the rows' own parameters and the masks; its sampled ids feed the
next step instead of the padding rows' ones.

Speculative steps (`ScheduledRequest.num_spec_tokens` = k > 0, one data replica and no
pipeline): the request's query tokens are its last token and k proposed ones; besides its usual
sampled row (the token after the last proposal) the program samples W extra "verify" rows, one
per proposed token (logits of the token before it, sampled at the proposal's own position, with
the request's seed and parameters), W a power-of-two multiple of K so few programs exist. The
host keeps the longest prefix of proposals equal to those samples plus the next sample
(`spec_decode.rejection.accept`) and reports it as `accepted_draft_ids` + `sampled_token_ids`.
A speculative step's sampled ids are never fed to the next program: the engine runs it
synchronously.

On a mesh (`mesh=`, see `llama.forward`) params and KV cache are placed by the sharding rules;
with `data` > 1 step 3 builds one ragged `StepInputs` per data replica (its own page pool, page
ids local to it), all padded to the same token/sequence buckets, stacked on a leading `[data]`
dim; sampling metadata, penalty rows and results are flat over `data * seq_bucket` rows.
With `pipeline` = S > 1 each replica's sequences are further split into S micro-batches of whole
sequences (`pipeline.split_microbatches`), each its own ragged step: the step's leading dims are
`[data?, S]` and the flat rows run replica-major, then micro-batch.
The sampler sees only the rows being sampled, vocab-sharded; XLA gathers those rows (never the
logits of every token, which the model does not compute outside prompt-logprob programs).

The model family (`models.family_of`) gives the forward, the parameter specs and the KV cache's
shape (from its attention backend) and sharding.

Penalty state lives on the device: `prompt_mask bool[R, V]` and `output_counts i32[R, V]`, one row
per running request. It is updated inside the step from the tokens being computed (a token at a
position past the prompt is an output token), so a preempted request that recomputes everything
rebuilds its counts exactly.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import math
import operator
import random
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import NamedSharding, PartitionSpec

from jaxinfer import attention, layers, pipeline
from jaxinfer import params as params_lib
from jaxinfer import sharding as shd
from jaxinfer.config import ModelConfig
from jaxinfer.engine import multihost
from jaxinfer.engine.request import PENDING_TOKEN
from jaxinfer.engine.scheduler import RunnerOutput, ScheduledRequest, SchedulerOutput
from jaxinfer.models import family_of
from jaxinfer.params import DTYPES
from jaxinfer.quantization import quantization_of
from jaxinfer.sampling import (
    SamplerOutput,
    SamplingMetadata,
    SamplingRows,
    compute_logprobs,
    sample,
)
from jaxinfer.sampling_params import MAX_LOGPROBS
from jaxinfer.spec_decode import rejection
from jaxinfer.step import StepInputs
from jaxinfer.structured import bitmask_width

logger = logging.getLogger(__name__)


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


@struct.dataclass
class PenaltyState:
    prompt_mask: jax.Array  # bool[R, V]
    output_counts: jax.Array  # i32[R, V]


@dataclasses.dataclass
class UnpackPlan:
    """Where a step's results go (host only: followers of a multi-host leader never see it)."""

    sample_ids: list[str]  # requests that sample, in the order of sample_slots
    sample_slots: np.ndarray  # i32[n] their result rows
    logprob_rows: list[tuple[str, int, int]]  # (request id, result row, k) asking for logprobs
    # (request id, token rows lo, hi, start position, prompt length, k) asking for prompt logprobs
    prompt_rows: list[tuple[str, int, int, int, int, int]]
    target_ids: np.ndarray  # i32[T] the prompt token each token row predicts
    # (request id, its result row, its first verify row, its proposed tokens) of speculating rows
    spec: list[tuple[str, int, int, list[int]]] = dataclasses.field(default_factory=list)
    num_seq_rows: int = 0  # S: verify row w is result row S + w


@dataclasses.dataclass
class Prepared:
    """A step's host inputs (`ModelRunner.prepare`): numpy pytrees plus the program's static key."""

    inputs: dict  # {"step": StepInputs, "extras": BatchExtras, "meta": SamplingMetadata} of numpy
    all_logits: bool  # the prompt-logprob variant of the program
    bucket: int  # token bucket
    page_bucket: int  # width of page_indices
    fetch_logprobs: bool  # some row asked for logprobs: fetch the sampler's logprob arrays too
    plan: UnpackPlan | None = None
    spec_width: int = 0  # W verify rows (speculative steps)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "plan": None}  # NOTE: a multi-host follower runs, never unpacks


@dataclasses.dataclass
class Launched:
    """A step running on the device (`ModelRunner.launch`): its results, not yet fetched."""

    sched: SchedulerOutput
    results: Any  # device arrays: (sampled ids, sampler output or None, prompt logprobs or None)
    plan: Any
    # Launched with `defer_sampling` and not sampled yet: (row logits, prompt logprobs, Prepared)
    deferred: Any = None


@dataclasses.dataclass
class TokenLogprobs:
    """Logprob of one chosen token plus the top-k alternatives (token id -> logprob)."""

    token_id: int
    logprob: float
    top: dict[int, float]


def _step(
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
        )
    prompt = compute_logprobs(logits, extras.target_ids, MAX_LOGPROBS) if all_logits else None
    next_tokens = jnp.zeros_like(prev_tokens).at[:num_seqs].set(out.token_ids[:num_seqs])
    return (out, prompt, row_logits), kv_caches, state, next_tokens


def _sample_step(
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


_REQUEST_ID = operator.attrgetter("request_id")


def _pack(inputs: dict) -> tuple[tuple[np.ndarray, ...], tuple]:
    """The step's host inputs as one flat buffer per dtype, plus the static layout that `_unpack`
    reverses inside the program: one device transfer of ~3 buffers instead of ~25 leaves (each
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


def _unpack(buffers: tuple[jax.Array, ...], layout: tuple) -> dict:
    treedef, spec = layout
    return jax.tree.unflatten(
        treedef, [buffers[b][o : o + math.prod(shape)].reshape(shape) for b, o, shape in spec]
    )


def _packed_step(
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
    inputs = _unpack(buffers, layout)
    extras = inputs["extras"].replace(token_bitmask=token_bitmask)
    return _step(
        params,
        cfg,
        kv_caches,
        state,
        prev_tokens,
        inputs["step"],
        extras,
        meta,
        all_logits=all_logits,
        **backends,
    )


def _packed_sample_step(
    state: PenaltyState, row_logits: jax.Array, buffers, *, layout: tuple, num_sample_rows: int
) -> tuple[SamplerOutput, jax.Array]:
    return _sample_step(
        state, row_logits, _unpack(buffers, layout), num_sample_rows=num_sample_rows
    )


def default_page_buckets(pages_per_seq: int, *, floor: int = 64) -> tuple[int, ...]:
    """pages_per_seq, then quarters of it while they hold at least `floor` pages.

    A step's `page_indices` is `[S, bucket]`: with 128K tokens of context in 16-token pages a full
    table is 8192 ids per sequence (8 MiB to build and move per 256-sequence step), while short
    sequences need few. Quarters keep the compiled-program count small (x1 up to 255 pages,
    x2 up to 1023, ...); below `floor` pages a table costs too little to be worth a program.
    """
    buckets = [pages_per_seq]
    while buckets[-1] // 4 >= floor:
        buckets.append(buckets[-1] // 4)
    return tuple(sorted(buckets))


def default_token_buckets(max_num_batched_tokens: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to the token budget (which is always the last bucket)."""
    buckets = [1 << i for i in range(max(1, math.ceil(math.log2(max_num_batched_tokens))))]
    return tuple(
        sorted({b for b in buckets if b < max_num_batched_tokens} | {max_num_batched_tokens})
    )


class ModelRunner:
    """Owns the device state (params, KV cache, penalty rows) and runs one step per call."""

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
    ) -> None:
        """`num_pages` and `max_num_seqs` are totals over the data replicas (each gets 1/data);
        `page_buckets` are the widths of `page_indices` (default `default_page_buckets`);
        `num_speculative_tokens` K and `spec_max_seqs` size the verify-row buckets (K, 2K, 4K..
        up to K x spec_max_seqs) that `warmup` compiles; `kv_cache_dtype="fp8"` stores the cache
        as `reference.Fp8KVCache` (see jaxinfer.attention)."""
        par = shd.Parallel.from_mesh(mesh)
        self.mesh = None if par.is_single else mesh  # NOTE: one device keeps the plain program
        self.data = par.data
        self.microbatches = par.pipeline  # NOTE: M = S micro-batches keep every stage busy
        self.cfg = cfg
        self.page_size, self.num_pages = page_size, num_pages
        self.max_model_len, self.max_num_seqs = max_model_len, max_num_seqs
        self.pages_per_seq = math.ceil(max_model_len / page_size)
        self.token_buckets = token_buckets or default_token_buckets(max_num_batched_tokens)
        if self.token_buckets[-1] < max_num_batched_tokens:
            raise ValueError(
                f"largest token bucket {self.token_buckets[-1]} is below "
                f"max_num_batched_tokens={max_num_batched_tokens}"
            )
        self.page_buckets = tuple(
            sorted(set(page_buckets or default_page_buckets(self.pages_per_seq)))
        )
        if self.page_buckets[-1] != self.pages_per_seq or self.page_buckets[0] < 1:
            raise ValueError(
                f"page_buckets={self.page_buckets} must be >= 1 and end at "
                f"max_model_len / page_size = {self.pages_per_seq}"
            )
        if par.pipeline > 1:
            # NOTE: a 1-token micro-batch takes the reference attention's single-token loop, which
            # reads the cache as a loop operand; the next tick's KV write into that cache then makes
            # XLA:CPU copy the whole cache. Micro-batches are padded to >= 2 tokens instead
            # (tests/test_pipeline.py guards the compiled programs).
            self.token_buckets = tuple(sorted({max(b, 2) for b in self.token_buckets}))
        if num_speculative_tokens and (self.data > 1 or self.microbatches > 1):
            raise ValueError(
                f"speculative decoding needs one data replica and no pipeline "
                f"stages (mesh data={self.data}, pipeline={self.microbatches})"
            )
        self.num_speculative_tokens = num_speculative_tokens
        self.spec_max_seqs = max(1, spec_max_seqs)
        self.spec_widths: tuple[int, ...] = ()
        if num_speculative_tokens:
            widths, w = [], num_speculative_tokens
            while True:
                widths.append(w)
                if w >= num_speculative_tokens * max(1, spec_max_seqs):
                    break
                w *= 2
            self.spec_widths = tuple(widths)
        if self.data > 1 and (num_pages % self.data or max_num_seqs % self.data):
            raise ValueError(
                f"num_pages={num_pages} and max_num_seqs={max_num_seqs} must be "
                f"multiples of data={self.data} (each replica gets an equal share)"
            )
        self.seqs_per_replica = max_num_seqs // self.data
        family = family_of(cfg)
        shape = family.kv_cache_shape(cfg, attention_backend, num_pages, page_size, par)
        family.check_kv_cache_dtype(
            cfg, attention.resolve_backend(attention_backend), kv_cache_dtype
        )
        if kv_cache_dtype == "fp8" and par.pipeline > 1:
            raise ValueError("kv_cache_dtype='fp8' is not supported with a pipeline mesh axis > 1")
        self.kv_cache_dtype = kv_cache_dtype

        def new_caches():
            return tuple(
                attention.new_kv_cache(shape, DTYPES[dtype], kv_cache_dtype)
                for _ in range(cfg.num_layers)
            )

        rows = max_num_seqs + 1  # the last row is a spare that padding writes into
        if self.mesh is None:
            # NOTE: everything the program takes is committed to the one device: outputs of a call
            # with a committed input are committed, so uncommitted initial caches would give the
            # first compiled program a signature no later call has (a recompile after warmup).
            device = self._device = _device_of(params)
            self.params = jax.device_put(params, device)
            self.kv_caches = jax.device_put(new_caches(), device)
            self.state = jax.device_put(
                PenaltyState(
                    jnp.zeros((rows, cfg.vocab_size), bool),
                    jnp.zeros((rows, cfg.vocab_size), jnp.int32),
                ),
                device,
            )
        else:
            rules = shd.model_rules(cfg, par)
            specs = family.param_specs(cfg, quantization=quantization_of(params))
            if par.pipeline > 1:  # layers stacked by stage (see jaxinfer.pipeline)
                self.params = pipeline.place_params(params, specs, mesh, rules)
            else:
                self.params = jax.device_put(  # a no-op for params the loader already placed
                    params, params_lib.shardings(specs, mesh, rules)
                )
            cache_sharding = jax.tree.map(
                lambda spec: NamedSharding(mesh, spec),
                family.kv_cache_specs(cfg, par, new_caches()[0]),
            )
            self._replicated = NamedSharding(mesh, PartitionSpec())
            self._step_sharding = (
                NamedSharding(mesh, PartitionSpec(shd.DATA)) if self.data > 1 else self._replicated
            )
            zeros = jax.jit(new_caches, out_shardings=(cache_sharding,) * cfg.num_layers)
            self.kv_caches = (
                zeros()
                if par.pipeline == 1
                else pipeline.stage_kv_caches(
                    cfg.num_layers,
                    par.pipeline,
                    shape,
                    DTYPES[dtype],
                    mesh,
                    family.kv_cache_spec(cfg, par),
                )
            )
            # the penalty rows split over the vocabulary like the logits they are applied to
            self.state = jax.jit(
                lambda: PenaltyState(
                    jnp.zeros((rows, cfg.vocab_size), bool),
                    jnp.zeros((rows, cfg.vocab_size), jnp.int32),
                ),
                out_shardings=NamedSharding(mesh, PartitionSpec(None, rules["vocab"])),
            )()
        # Sampled-id rows of the largest program (every program pads its ids to this many).
        self.num_sample_rows = (
            self.data * self.microbatches * self.seq_bucket(self.token_buckets[-1])
        )
        zeros = functools.partial(jnp.zeros, self.num_sample_rows, jnp.int32)
        self._prev_tokens = (
            jax.device_put(zeros(), device)
            if self.mesh is None
            else jax.jit(zeros, out_shardings=self._replicated)()
        )
        # The persistent input batch: row r of every array belongs to the request in _rows with
        # value r (the same row as its penalty state); row max_num_seqs is the padding spare.
        self._rows: dict[str, int] = {}  # request id -> its row
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))
        self._page_table = np.zeros((max_num_seqs + 1, self.pages_per_seq), np.int32)
        self._num_pages = np.zeros(max_num_seqs + 1, np.int32)  # filled entries of each table
        self._prompt_len = np.zeros(max_num_seqs + 1, np.int32)
        self._wants_prompt_lps = np.zeros(max_num_seqs + 1, bool)
        self._last_sample = np.full(max_num_seqs + 1, -1, np.int32)  # row of _prev_tokens, -1: none
        self._sampling = SamplingRows(max_num_seqs)
        self.bitmask_width = bitmask_width(cfg.vocab_size)
        self._all_allowed: dict[int, jax.Array] = {}  # rows -> i32[rows, W] of -1 on the device
        self._meta_cache: tuple[int, np.ndarray, SamplingMetadata, bool] | None = None
        self._seeds: dict[str, int] = {}  # NOTE: kept across preemption (resamples identically)
        self._rng = random.Random()
        self.attention_backend = attention_backend = attention.resolve_backend(attention_backend)
        self.linear_backend = linear_backend = layers.resolve_linear_backend(linear_backend)
        if self.mesh is None:  # inputs packed into one buffer per dtype (see _pack)
            self._jit = jax.jit(
                functools.partial(
                    _packed_step, attention_backend=attention_backend, linear_backend=linear_backend
                ),
                static_argnames=("cfg", "all_logits", "layout"),
                donate_argnames=("kv_caches", "state"),
            )
        else:
            # NOTE: what a step carries to the next (KV cache, penalty state, fed-back ids) leaves
            # it laid out as it came in: with the partitioner's choice instead, the first call's
            # outputs would give the second call other input shardings (a recompile of every
            # program warmup built, on the first real request).
            carried = jax.tree.map(
                lambda x: x.sharding, (self.kv_caches, self.state, self._prev_tokens)
            )
            self._jit = jax.jit(
                functools.partial(
                    _step,
                    attention_backend=attention_backend,
                    linear_backend=linear_backend,
                    mesh=self.mesh,
                ),
                static_argnames=("cfg", "all_logits"),
                donate_argnames=("kv_caches", "state"),
                out_shardings=(None, *carried),
            )
        # Steps sampling structured-output rows run the step program up to the rows' logits,
        # then this one (see `sample`); single device only (on a mesh they sample in the step).
        self.split_sampling = self.mesh is None
        self._sample_jit = jax.jit(
            functools.partial(_packed_sample_step, num_sample_rows=self.num_sample_rows),
            static_argnames=("layout",),
        )
        self.num_compiled = 0
        # (token bucket, page bucket, logits, verify rows)
        self._compiled: set[tuple[int, int, bool, int]] = set()
        self._compiled_samplers: set[int] = set()  # sampled rows of each sampler program
        self._padding_metas: dict[int, SamplingMetadata] = {}
        # id(host meta) -> (that meta, its device copy): see `_meta_on_device`
        self._device_metas: dict[int, tuple[SamplingMetadata, SamplingMetadata]] = {}

    @property
    def kv_cache_bytes(self) -> int:
        return sum(c.size * c.dtype.itemsize for c in jax.tree.leaves(self.kv_caches))

    def bytes_per_device(self) -> dict[str, int]:
        """Parameter and KV-cache bytes held by the first device."""
        dev = jax.devices()[0] if self.mesh is None else self.mesh.devices.flat[0]

        def held(tree: Any) -> int:
            return sum(
                s.data.nbytes
                for x in jax.tree.leaves(tree)
                for s in x.addressable_shards
                if s.device == dev
            )

        return {"params": held(self.params), "kv_cache": held(self.kv_caches)}

    def seq_bucket(self, num_tokens: int) -> int:
        return min(num_tokens, self.seqs_per_replica)

    def token_bucket(self, n: int) -> int:
        for b in self.token_buckets:
            if b >= n:
                return b
        raise ValueError(f"step of {n} tokens exceeds the largest bucket {self.token_buckets[-1]}")

    def spec_width(self, n: int) -> int:
        """Verify rows of a step that verifies `n` proposed tokens (0 for none)."""
        if n == 0:
            return 0
        for w in self.spec_widths:
            if w >= n:
                return w
        w = self.spec_widths[-1] if self.spec_widths else 1
        while w < n:  # more proposals than configured (a hand-built schedule): still correct
            w *= 2
        return w

    def page_bucket(self, n: int) -> int:
        for b in self.page_buckets:
            if b >= n:
                return b
        raise ValueError(
            f"a page table of {n} pages exceeds max_model_len / page_size = {self.pages_per_seq}"
        )

    def _release(self, request_ids: list[str], *, finished: bool) -> None:
        """Frees rows; a preempted request keeps its seed so it resamples identically."""
        for rid in request_ids:
            row = self._rows.pop(rid, None)
            if row is not None:
                self._free_rows.append(row)
                self._last_sample[row] = -1
            if finished:
                self._seeds.pop(rid, None)

    def _join(self, s: ScheduledRequest) -> int:
        """Fills a row for a request that (re)joins the batch; returns the row."""
        req = s.request
        rid, sp = req.request_id, req.sampling
        row = self._rows.get(rid)
        if row is None:
            if not self._free_rows:
                raise RuntimeError(
                    f"request {rid!r}: no free row (more than max_num_seqs="
                    f"{self.max_num_seqs} running requests)"
                )
            row = self._rows[rid] = self._free_rows.pop()
        pages, old = len(s.new_page_ids), int(self._num_pages[row])
        if pages > self.pages_per_seq:
            raise ValueError(
                f"request {rid!r}: page table of {pages} pages exceeds "
                f"max_model_len / page_size = {self.pages_per_seq}"
            )
        self._page_table[row, :pages] = s.new_page_ids
        self._page_table[row, pages:old] = 0
        self._num_pages[row] = pages
        self._prompt_len[row] = req.num_prompt_tokens
        self._wants_prompt_lps[row] = sp.prompt_logprobs is not None
        self._last_sample[row] = -1
        seed = self._seeds.get(rid)
        if seed is None:
            seed = self._seeds[rid] = sp.seed if sp.seed is not None else self._rng.getrandbits(63)
        suppress: list[int] = []
        if sp.min_tokens:  # stop ids (and EOS) are forbidden until min_tokens outputs exist
            suppress = list(sp.stop_token_ids or []) + (
                [] if sp.ignore_eos else list(req.eos_token_ids)
            )
        self._sampling.set(row, sp, seed, suppress, req.num_prompt_tokens + sp.min_tokens)
        return row

    def _extend(self, row: int, s: ScheduledRequest) -> None:
        """Appends a running request's newly allocated pages to its row's page table."""
        old = int(self._num_pages[row])
        new = old + len(s.new_page_ids)
        if new > self.pages_per_seq:
            raise ValueError(
                f"request {s.request.request_id!r}: page table of {new} pages exceeds "
                f"max_model_len / page_size = {self.pages_per_seq}"
            )
        self._page_table[row, old:new] = s.new_page_ids
        self._num_pages[row] = new

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        prepared = self.prepare(sched)
        if prepared is None:
            return RunnerOutput(sampled_token_ids={})
        return self._unpack(prepared.plan, *self.run(prepared))

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
        inputs = prepared.inputs
        if defer_sampling:
            if not self.split_sampling or prepared.spec_width:
                raise RuntimeError("defer_sampling needs one device and no speculative tokens")
            # NOTE: the step program's own sampler then runs on padding rows (greedy, nothing
            # else: ~15 ms of a ~300 ms 64-row decode step on XLA:CPU), so no program is compiled
            # for it; skipping the sampler under a lax.cond instead measured every fused step
            # ~1.4x slower (416 vs 288 ms, separate runs at load 6-7: BENCHMARKS.md).
            inputs = {**inputs, "meta": self._padding_meta(len(inputs["extras"].seq_rows))}
        out, prompt, row_logits = self._call(inputs, prepared.all_logits)
        self._note_compiled(prepared)
        if defer_sampling:
            return Launched(sched, None, prepared.plan, deferred=(row_logits, prompt, prepared))
        return Launched(sched, self._wanted(prepared, (out, prompt)), prepared.plan)

    def _padding_meta(self, rows: int) -> SamplingMetadata:
        """Sampling metadata of `rows` padding rows (greedy, no penalties, no logprobs)."""
        meta = self._padding_metas.get(rows)
        if meta is None or meta.suppress_ids.shape != (rows, self._sampling.suppress_ids.shape[1]):
            meta = self._padding_metas[rows] = self._sampling.gather(
                np.full(rows, self.max_num_seqs, np.int32)
            )
        return meta

    def sample(self, launched: Launched) -> None:
        """Launches the sampler of a step launched with `defer_sampling`, under the bitmask rows
        of `launched.sched` (`bitmask_rows` / `token_bitmask`, filled since the launch); the
        sampled ids feed the next step as usual. `collect` then waits for it."""
        if launched.deferred is None:
            raise RuntimeError("sample() needs a step launched with defer_sampling")
        row_logits, prompt, prepared = launched.deferred
        launched.deferred = None
        bitmask = np.full((row_logits.shape[0], self.bitmask_width), -1, np.int32)
        self._place_bitmask(launched.sched, prepared.plan, bitmask)
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
        buffers, layout = _pack(host)  # NOTE: one transfer, as for the step program
        out, self._prev_tokens = self._sample_jit(self.state, row_logits, buffers, layout=layout)
        if bitmask.shape[0] not in self._compiled_samplers:
            self._compiled_samplers.add(bitmask.shape[0])
            self.num_compiled = len(self._compiled) + len(self._compiled_samplers)
        return out

    def collect(self, launched: Launched) -> RunnerOutput:
        """Waits for a launched step and unpacks its results."""
        return self._unpack(launched.plan, *jax.device_get(launched.results))

    def prepare(self, sched: SchedulerOutput) -> Prepared | None:
        """Host half of a step: patches the persistent batch and builds every input as numpy
        (None: nothing to run).

        NOTE: apart from its unpacking plan (which stays on this process) the result is plain numpy
        plus Python scalars, so a multi-host driver can build it on one process and broadcast it;
        `run` on every process then does the device half.
        """
        self._release(sched.finished, finished=True)
        self._release(sched.preempted, finished=False)
        if not sched.scheduled:
            return None
        prepared = self._prepare(sched.scheduled)
        if sched.bitmask_rows and sched.token_bitmask is not None:
            extras = prepared.inputs["extras"]
            bitmask = np.full((len(extras.seq_rows), self.bitmask_width), -1, np.int32)
            self._place_bitmask(sched, prepared.plan, bitmask)
            prepared.inputs["extras"] = extras.replace(token_bitmask=bitmask)
        return prepared

    @staticmethod
    def _place_bitmask(
        sched: SchedulerOutput,
        plan: UnpackPlan,
        bitmask: np.ndarray,  # i32[rows, ceil(V / 32)] all ones (-1), patched here
    ) -> None:
        """Structured output: each constrained row's allowed tokens into its result row."""
        if not sched.bitmask_rows or sched.token_bitmask is None:
            return
        for rid, slot in zip(plan.sample_ids, plan.sample_slots.tolist()):
            k = sched.bitmask_rows.get(rid)
            if k is not None:
                bitmask[slot] = sched.token_bitmask[k]

    def run(self, prepared: Prepared) -> tuple[Any, Any, Any]:
        """Device half: one transfer in, the jitted step, one transfer out of what the step needs:
        (sampled ids, sampler output or None, prompt logprobs or None) as numpy."""
        out, prompt, _ = self._call(prepared.inputs, prepared.all_logits)
        results = self._wanted(prepared, (out, prompt))
        self._note_compiled(prepared)
        return multihost.device_get(results)  # NOTE: results may span other processes

    @staticmethod
    def _wanted(prepared: Prepared, results: tuple[Any, Any]) -> tuple[Any, Any, Any]:
        """Only the device arrays the host will read: no logprob arrays unless a row asked."""
        out, prompt = results
        return out.token_ids, out if prepared.fetch_logprobs else None, prompt

    def _note_compiled(self, prepared: Prepared) -> None:
        key = (prepared.bucket, prepared.page_bucket, prepared.all_logits, prepared.spec_width)
        if key not in self._compiled:
            self._compiled.add(key)
            self.num_compiled = len(self._compiled) + len(self._compiled_samplers)

    def compiled_program_count(self) -> int:
        """Programs in the step and sampler functions' own jit caches (a recompile would grow
        them)."""
        return self._jit._cache_size() + self._sample_jit._cache_size()

    def _args(self, inputs: dict, all_logits: bool) -> tuple[tuple, dict]:
        """The step program's arguments for host `inputs`, moved to the device in one transfer."""
        head = (self.params, self.cfg, self.kv_caches, self.state, self._prev_tokens)
        extras = inputs["extras"]
        bitmask = extras.token_bitmask
        if self.mesh is None:
            # NOTE: numpy buffers go straight to the jitted call, whose C++ path moves them to
            # the device faster than a separate `jax.device_put` (~0.3 ms less per step).
            # (the bitmask is its own argument; a None leaf packs nothing)
            buffers, layout = _pack(
                {
                    "step": inputs["step"],
                    "extras": extras if bitmask is None else extras.replace(token_bitmask=None),
                }
            )
            rows = len(extras.seq_rows)
            if bitmask is None:
                bitmask = self._all_allowed.get(rows)
                if bitmask is None:
                    bitmask = self._all_allowed[rows] = jax.device_put(
                        np.full((rows, self.bitmask_width), -1, np.int32), self._device
                    )
            else:  # committed like the cached one: the same program either way
                bitmask = jax.device_put(bitmask, self._device)
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
        dev = self._put(inputs)
        return (*head, dev["step"], dev["extras"], dev["meta"]), {"all_logits": all_logits}

    def _meta_on_device(self, meta: SamplingMetadata) -> SamplingMetadata:
        """`meta` moved to the device once: `_prepare` returns the same host object while the
        sampled rows and their parameters are unchanged (`_meta_cache`), so a steady decode
        sends no sampling parameters at all. A few recent ones are kept (the padding rows' meta
        of split steps alternates with the real one)."""
        key = id(meta)
        hit = self._device_metas.get(key)
        if hit is not None and hit[0] is meta:
            return hit[1]
        dev = jax.device_put(meta, self._device)
        if len(self._device_metas) >= 4:
            self._device_metas.pop(next(iter(self._device_metas)))
        self._device_metas[key] = (meta, dev)
        return dev

    def _call(self, inputs: dict, all_logits: bool) -> tuple[Any, Any, Any]:
        """Runs the step program on host `inputs` (device results: sampler output, prompt
        logprobs, the sampled rows' logits)."""
        args, kwargs = self._args(inputs, all_logits)
        results, self.kv_caches, self.state, self._prev_tokens = self._jit(*args, **kwargs)
        return results

    def _put(self, inputs: dict) -> dict:
        shardings = jax.tree.map(lambda _: self._replicated, inputs)
        shardings["step"] = jax.tree.map(lambda _: self._step_sharding, inputs["step"])
        return shd.device_put_global(inputs, shardings)  # jax.device_put on one process

    def _groups(self, scheduled: list[ScheduledRequest], q_lens: np.ndarray) -> np.ndarray | None:
        """i32[n] ragged group (replica-major, then micro-batch) of each scheduled sequence;
        None when there is one group."""
        if self.data == 1 and self.microbatches == 1:
            return None
        replica = np.array([s.replica for s in scheduled], np.int32)
        if self.microbatches == 1:
            return replica
        group = np.zeros(len(scheduled), np.int32)
        for r in range(self.data):  # whole sequences per micro-batch (pipeline.split_microbatches)
            idx = np.flatnonzero(replica == r)
            for m, mb in enumerate(
                pipeline.split_microbatches(q_lens[idx].tolist(), self.microbatches)
            ):
                group[idx[mb]] = r * self.microbatches + m
        return group

    def _prepare(self, scheduled: list[ScheduledRequest]) -> Prepared:
        # NOTE: no Python loop per request: one C pass (`zip(*scheduled)`) turns the step's
        # ScheduledRequest tuples into a column per field; the checks and gathers that only matter
        # with proposals or prompt logprobs are skipped without them (a decode step has neither)
        n = len(scheduled)
        requests, token_lists, starts, new_pages, samples, _, joined, _, num_spec = zip(*scheduled)
        ids = list(map(_REQUEST_ID, requests))
        for i in itertools.compress(range(n), joined):
            self._join(scheduled[i])
        rows = list(map(self._rows.get, ids))
        if None in rows:
            raise RuntimeError(
                f"request {ids[rows.index(None)]!r} is scheduled as running but "
                f"has no row (its first schedule was not prepared)"
            )
        for i in itertools.compress(range(n), new_pages):
            if not joined[i]:
                self._extend(rows[i], scheduled[i])
        q_lens = list(map(len, token_lists))
        tokens = list(itertools.chain.from_iterable(token_lists))
        sample_ids = list(itertools.compress(ids, samples))
        n_spec = sum(num_spec)
        rows_a = np.array(rows, np.int32)
        starts_a = np.array(starts, np.int32)
        q_a = np.array(q_lens, np.int32)
        tokens_a = np.array(tokens, np.int32)
        sample_a = np.array(samples, bool)
        spec_a = np.array(num_spec, np.int32) if n_spec else np.zeros(n, np.int32)
        spec_width = self.spec_width(n_spec)
        group = self._groups(scheduled, q_a)
        if spec_width and group is not None:
            raise RuntimeError("speculative tokens scheduled on a mesh with data or pipeline > 1")
        if n_spec and (((spec_a > 0) & ~sample_a).any() or (spec_a >= q_a).any()):
            raise RuntimeError("a speculative chunk must sample and hold its last known token")
        if group is None:
            order, n_tok = None, len(tokens)
        else:
            order = np.argsort(group, kind="stable")
            n_tok = int(np.bincount(group, weights=q_a).max())
        t_bucket = self.token_bucket(n_tok)
        p_bucket = self.page_bucket(-(-int((starts_a + q_a).max()) // self.page_size))
        all_logits = bool(self._wants_prompt_lps.any()) and bool(
            (self._wants_prompt_lps[rows_a] & (starts_a < self._prompt_len[rows_a])).any()
        )
        if order is not None:  # tokens of the sequences in group order
            src = np.cumsum(q_a) - q_a
            src = np.repeat(src[order], q_a[order]) + _ranks(q_a[order])
            tokens_a = tokens_a[src]
            rows_a, starts_a, q_a, group = rows_a[order], starts_a[order], q_a[order], group[order]
            sample_a, joined_a = sample_a[order], np.array(joined, bool)[order]
        else:
            joined_a = np.array(joined, bool)
        step, extras, slot, tok_lo = self._arrays(
            t_bucket,
            p_bucket,
            all_logits,
            rows_a,
            starts_a,
            q_a,
            tokens_a,
            joined_a,
            group,
            spec_a,
            spec_width,
        )
        if order is not None:  # back to scheduled order
            slot[order], tok_lo[order] = slot.copy(), tok_lo.copy()
            rows_a, starts_a, q_a, sample_a = (
                np.array(rows, np.int32),
                np.array(starts, np.int32),
                np.array(q_lens, np.int32),
                np.array(samples, bool),
            )
        # Rows whose pending token this step samples: the next step feeds it from _prev_tokens.
        self._last_sample.fill(-1)
        plain = (sample_a & (spec_a == 0)) if n_spec else sample_a
        self._last_sample[rows_a[plain]] = slot[plain]
        meta_rows = extras.seq_rows
        if spec_width:
            spec_rows = np.full(spec_width, self.max_num_seqs, np.int32)
            spec_rows[: int(spec_a.sum())] = np.repeat(rows_a, spec_a)
            meta_rows = np.concatenate([extras.seq_rows, spec_rows])

        version = self._sampling.version
        cache = self._meta_cache
        if (
            cache is not None
            and cache[0] == version
            and cache[1].shape == meta_rows.shape
            and (cache[1] == meta_rows).all()
        ):
            meta, fetch_logprobs = cache[2], cache[3]
        else:
            meta = self._sampling.gather(meta_rows)
            fetch_logprobs = bool(meta.wants_logprobs.any())
            self._meta_cache = (version, meta_rows, meta, fetch_logprobs)

        logprob_rows, prompt_rows, spec = [], [], []
        s_rows = len(extras.seq_rows)
        if n_spec:
            spec_first = np.cumsum(spec_a) - spec_a  # i32[n] each sequence's first verify row
        for i in np.flatnonzero(spec_a).tolist() if n_spec else ():
            s = scheduled[i]
            k = s.num_spec_tokens
            spec.append(
                (
                    s.request.request_id,
                    int(slot[i]),
                    s_rows + int(spec_first[i]),
                    list(s.token_ids[len(s.token_ids) - k :]),
                )
            )
        if fetch_logprobs:
            for i in np.flatnonzero(self._sampling.wants_logprobs[rows_a] & sample_a).tolist():
                s = scheduled[i]
                logprob_rows.append(
                    (s.request.request_id, int(slot[i]), s.request.sampling.logprobs)
                )
        if all_logits:
            for i in np.flatnonzero(self._wants_prompt_lps[rows_a]).tolist():
                s = scheduled[i]
                req, lo = s.request, int(tok_lo[i])
                nxt = req.prompt_token_ids[s.start_pos + 1 : s.start_pos + 1 + len(s.token_ids)]
                extras.target_ids[lo : lo + len(nxt)] = nxt
                prompt_rows.append(
                    (
                        req.request_id,
                        lo,
                        lo + len(s.token_ids),
                        s.start_pos,
                        req.num_prompt_tokens,
                        req.sampling.prompt_logprobs,
                    )
                )
        plan = UnpackPlan(
            sample_ids, slot[sample_a], logprob_rows, prompt_rows, extras.target_ids, spec, s_rows
        )
        return Prepared(
            {"step": step, "extras": extras, "meta": meta},
            all_logits,
            t_bucket,
            p_bucket,
            fetch_logprobs,
            plan,
            spec_width,
        )

    def _arrays(
        self,
        t_bucket: int,
        p_bucket: int,
        all_logits: bool,
        rows: np.ndarray,  # i32[n] persistent row of each sequence
        starts: np.ndarray,  # i32[n] tokens already in the cache
        q_lens: np.ndarray,  # i32[n] tokens computed this step
        tokens: np.ndarray,  # i32[sum(q_lens)] their ids (PENDING_TOKEN: fed on device)
        joined: np.ndarray,  # bool[n] the row's request joined this step
        group: np.ndarray | None,  # i32[n] ragged group, non-decreasing (None: all 0)
        num_spec: np.ndarray | None = None,  # i32[n] proposed tokens (last of each chunk)
        spec_width: int = 0,  # W verify rows (one group only)
    ) -> tuple[StepInputs, BatchExtras, np.ndarray, np.ndarray]:
        """The step's inputs for sequences in group order, by vectorized gathers and scatters.

        Returns (StepInputs, BatchExtras, each sequence's result row i32[n], each sequence's first
        flat token row i32[n]).
        """
        n_groups = self.data * self.microbatches  # replica-major, then micro-batch
        t, s_bucket, ps = t_bucket, self.seq_bucket(t_bucket), self.page_size
        n = len(rows)
        if group is None and len(tokens) == n:
            # A decode step on one group (one token per sequence): a sequence's result row, its
            # token's flat row and its index are the same, so no cumsum, scatter or bincount.
            idx = np.arange(n, dtype=np.int32)
            slot = tok_lo = in_group = seq_of = tok = idx
            pos, row_of = starts, rows
            group_tokens = np.array([n], np.int32)
            cu_q_lens = np.minimum(np.arange(s_bucket + 1, dtype=np.int32), n).reshape(1, -1)
            num_seqs = np.array([[n]], np.int32)
        else:
            before = np.cumsum(q_lens) - q_lens  # i32[n] tokens of earlier sequences (all groups)
            if group is None:
                group = np.zeros(n, np.int32)
                first = np.zeros(n, np.int64)
            else:
                first = np.searchsorted(group, group)  # i64[n] index of the group's first sequence
            in_group = before - before[first]  # i32[n] tokens of earlier sequences in the group
            slot = group * s_bucket + (np.arange(n) - first)  # i32[n] flat sequence (result) row
            tok_lo = group * t + in_group  # i32[n] flat row of the sequence's first token
            if len(tokens) == n:  # one token per sequence (a decode step): no ragged expansion
                seq_of, tok, pos, row_of = np.arange(n), tok_lo, starts, rows
            else:
                seq_of = np.repeat(np.arange(n), q_lens)  # i32[T_real] sequence of each token
                offset = _ranks(q_lens)  # i32[T_real] index of each token within its sequence
                tok = tok_lo[seq_of] + offset  # i32[T_real] flat token row
                pos = starts[seq_of] + offset  # i32[T_real] absolute position
                row_of = rows[seq_of]
            group_tokens = np.bincount(group, weights=q_lens, minlength=n_groups).astype(np.int32)
            cu_q_lens = np.repeat(group_tokens, s_bucket + 1).reshape(n_groups, s_bucket + 1)
            cu_q_lens[:, 0] = 0
            cu_q_lens.reshape(-1)[group * (s_bucket + 1) + (np.arange(n) - first) + 1] = (
                in_group + q_lens
            )
            num_seqs = np.bincount(group, minlength=n_groups).astype(np.int32).reshape(n_groups, 1)
        kv_end = starts + q_lens

        token_ids = np.zeros(n_groups * t, np.int32)
        token_ids[tok] = np.where(tokens == PENDING_TOKEN, 0, tokens)
        positions = np.zeros(n_groups * t, np.int32)
        positions[tok] = pos
        slot_mapping = np.full(n_groups * t, -1, np.int32)
        slot_mapping[tok] = self._page_table[row_of, pos // ps] * ps + pos % ps
        kv_lens = np.zeros(n_groups * s_bucket, np.int32)
        kv_lens[slot] = kv_end
        page_indices = np.zeros((n_groups * s_bucket, p_bucket), np.int32)
        page_indices[slot] = self._page_table[rows, :p_bucket]
        if all_logits:
            every = np.arange(t, dtype=np.int32)
            logits_indices = np.where(every < group_tokens[:, None], every, 0).astype(np.int32)
        else:
            logits_indices = np.zeros(n_groups * s_bucket, np.int32)
            logits_indices[slot] = in_group + q_lens - 1

        token_seq = np.full(n_groups * t, n_groups * s_bucket, np.int32)
        token_seq[tok] = slot[seq_of]
        token_is_output = np.zeros(n_groups * t, bool)
        token_is_output[tok] = pos >= self._prompt_len[row_of]
        seq_rows = np.full(n_groups * s_bucket, self.max_num_seqs, np.int32)
        seq_rows[slot] = rows
        reset_rows = np.zeros(n_groups * s_bucket, bool)
        reset_rows[slot] = joined
        sample_rows = np.zeros(n_groups * s_bucket, np.int32)
        sample_rows[slot] = tok_lo + q_lens - 1
        spec_seq = np.zeros(spec_width, np.int32)
        spec_positions = np.zeros(spec_width, np.int32)
        if spec_width:
            # Verify row j of a chunk with k proposals reads the logits of the token before
            # proposal j (chunk offset q - k - 1 + j) and samples position start + q - k + j.
            k = num_spec
            spec_of = np.repeat(np.arange(n), k)  # i32[n_spec] sequence of each verify row
            j = _ranks(k)
            n_spec = len(spec_of)
            spec_tok = np.zeros(spec_width, np.int32)
            spec_tok[:n_spec] = (tok_lo + q_lens - k - 1)[spec_of] + j
            spec_seq[:n_spec] = slot[spec_of]
            spec_positions[:n_spec] = (starts + q_lens - k)[spec_of] + j
            sample_rows = np.concatenate([sample_rows, spec_tok])
            if not all_logits:
                logits_indices = np.concatenate([logits_indices, spec_tok])
        feed_rows = np.full(n_groups * t, -1, np.int32)
        pending = tokens == PENDING_TOKEN
        if pending.any():
            feed = self._last_sample[row_of[pending]]
            bad = (feed < 0) | (pos[pending] != kv_end[seq_of[pending]] - 1)
            if bad.any():
                rid = next(r for r, v in self._rows.items() if v == row_of[pending][bad][0])
                raise RuntimeError(
                    f"request {rid!r}: pending token not sampled by the previous step"
                )
            feed_rows[tok[pending]] = feed

        lead = tuple(d for d in (self.data, self.microbatches) if d > 1)  # [data?, M?, ...]
        step = StepInputs(
            token_ids=token_ids.reshape(lead + (t,)),
            positions=positions.reshape(lead + (t,)),
            slot_mapping=slot_mapping.reshape(lead + (t,)),
            kv_lens=kv_lens.reshape(lead + (s_bucket,)),
            page_indices=page_indices.reshape(lead + (s_bucket, p_bucket)),
            cu_q_lens=cu_q_lens.reshape(lead + (s_bucket + 1,)),
            num_seqs=num_seqs.reshape(lead + (1,)),
            logits_indices=logits_indices.reshape(lead + (-1,)),
        )
        extras = BatchExtras(
            token_seq=token_seq,
            token_is_output=token_is_output,
            seq_rows=seq_rows,
            reset_rows=reset_rows,
            sample_rows=sample_rows,
            target_ids=np.zeros(n_groups * t, np.int32),
            feed_rows=feed_rows,
            spec_seq=spec_seq,
            spec_positions=spec_positions,
            token_bitmask=None,
        )
        return step, extras, slot.astype(np.int32), tok_lo.astype(np.int32)

    def _unpack(
        self, plan: UnpackPlan, token_ids: np.ndarray, out: Any, prompt: Any
    ) -> RunnerOutput:
        sampled = dict(zip(plan.sample_ids, token_ids[plan.sample_slots].tolist()))
        accepted, draft_lps, final_row = {}, {}, {}
        for rid, slot, lo, drafts in plan.spec:
            k = len(drafts)
            targets = token_ids[lo : lo + k].tolist() + [sampled[rid]]
            emitted, a = rejection.accept(drafts, targets)
            accepted[rid], sampled[rid] = emitted[:-1], emitted[-1]
            final_row[rid] = (lo + a if a < k else slot, lo)

        def token_lps(i: int, k: int) -> TokenLogprobs:
            return TokenLogprobs(
                int(token_ids[i]),
                float(out.logprobs[i]),
                dict(zip(out.topk_ids[i, :k].tolist(), out.topk_logprobs[i, :k].tolist())),
            )

        logprobs, prompt_lps = {}, {}
        for rid, i, k in plan.logprob_rows:
            if rid in final_row:
                i, lo = final_row[rid]
                draft_lps[rid] = [token_lps(lo + j, k) for j in range(len(accepted[rid]))]
            logprobs[rid] = token_lps(i, k)
        for rid, lo, hi, start, num_prompt, k in plan.prompt_rows:
            chosen, top_ids, top_lps = prompt
            entries = {}
            for t in range(lo, hi):
                pos = start + (t - lo) + 1  # the prompt position this row predicts
                if pos >= num_prompt:
                    break
                entries[pos] = TokenLogprobs(
                    int(plan.target_ids[t]),
                    float(chosen[t]),
                    dict(zip(top_ids[t, :k].tolist(), top_lps[t, :k].tolist())),
                )
            prompt_lps[rid] = entries
        return RunnerOutput(
            sampled_token_ids=sampled,
            logprobs=logprobs,
            prompt_logprobs=prompt_lps,
            accepted_draft_ids=accepted,
            draft_logprobs=draft_lps,
        )

    def _idle_inputs(
        self, t_bucket: int, all_logits: bool, p_bucket: int, spec_width: int = 0
    ) -> dict:
        """Inputs of a step that computes nothing (no sequences): used to compile a bucket."""
        none = np.zeros(0, np.int32)
        step, extras, _, _ = self._arrays(
            t_bucket,
            p_bucket,
            all_logits,
            none,
            none,
            none,
            none,
            np.zeros(0, bool),
            None if self.data * self.microbatches == 1 else none,
            none,
            spec_width,
        )
        rows = np.full(extras.seq_rows.shape[0] + spec_width, self.max_num_seqs, np.int32)
        return {"step": step, "extras": extras, "meta": self._sampling.gather(rows)}

    def lower(
        self,
        t_bucket: int,
        all_logits: bool = False,
        page_bucket: int | None = None,
        spec_width: int = 0,
    ) -> Any:
        """The bucket's step program, lowered (for HLO inspection and tests); the page bucket
        defaults to the largest."""
        p_bucket = page_bucket or self.pages_per_seq
        args, kwargs = self._args(
            self._idle_inputs(t_bucket, all_logits, p_bucket, spec_width), all_logits
        )
        return self._jit.lower(*args, **kwargs)

    def warmup(self, *, structured: bool = False) -> int:
        """Compiles every (token bucket, page bucket, logits variant) program, and with
        `structured` (and `split_sampling`) the sampler program of each sequence bucket that steps
        sampling structured-output rows run (`sample`); returns how many were built."""
        start = time.perf_counter()
        self._last_sample.fill(-1)  # NOTE: warmup programs overwrite the previous sampled ids
        if structured and self.split_sampling:
            rows_done: set[int] = set()
            for t_bucket in self.token_buckets:
                inputs = self._idle_inputs(t_bucket, False, self.page_buckets[0])
                rows = inputs["extras"].seq_rows.shape[0]
                if rows in rows_done:
                    continue
                rows_done.add(rows)
                _, _, row_logits = self._call(inputs, False)
                out = self._call_sampler(
                    row_logits, inputs, np.full((rows, self.bitmask_width), -1, np.int32)
                )
                jax.block_until_ready(out)
        for t_bucket in self.token_buckets:
            for p_bucket in self.page_buckets:
                for all_logits in (False, True):
                    inputs = self._idle_inputs(t_bucket, all_logits, p_bucket)
                    out, _, _ = self._call(inputs, all_logits)
                    jax.block_until_ready(out)
                    self._note_compiled(Prepared(inputs, all_logits, t_bucket, p_bucket, False))
            # Speculative steps of decoding requests only (a step that also prefills compiles
            # its program when it first runs): more proposals than the previous width, at
            # least one sequence per K of them, at most spec_max_seqs sequences.
            prev = 0
            for w in self.spec_widths:
                lo = prev + 1 + -(-(prev + 1) // self.num_speculative_tokens)
                hi = w + self.spec_max_seqs
                prev = w
                if (
                    not self.token_bucket(min(lo, self.token_buckets[-1]))
                    <= t_bucket
                    <= (self.token_bucket(min(hi, self.token_buckets[-1])))
                ):
                    continue
                for p_bucket in self.page_buckets:
                    inputs = self._idle_inputs(t_bucket, False, p_bucket, w)
                    out, _, _ = self._call(inputs, False)
                    jax.block_until_ready(out)
                    self._note_compiled(
                        Prepared(inputs, False, t_bucket, p_bucket, False, spec_width=w)
                    )
        logger.info(
            "warmup compiled %d programs in %.1fs", self.num_compiled, time.perf_counter() - start
        )
        return self.num_compiled


def _device_of(params: Any) -> jax.Device:
    """The device the (single-device) params live on; the default device for host arrays."""
    for leaf in jax.tree.leaves(params):
        if isinstance(leaf, jax.Array):
            return next(iter(leaf.devices()))
    return jax.devices()[0]


def _ranks(counts: np.ndarray) -> np.ndarray:
    """i32[sum(counts)] 0, 1, ..., counts[0]-1, 0, 1, ..., counts[1]-1, ..."""
    total = int(counts.sum())
    return (np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)).astype(np.int32)
