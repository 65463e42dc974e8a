"""ModelRunner: the only module that calls JAX on the hot path.

Flow of `execute(SchedulerOutput) -> RunnerOutput`:
  1. Pick the smallest token bucket that holds the step's tokens (the sequence bucket follows
     from it), so the set of compiled programs is fixed and `warmup()` builds all of them.
  2. Build every input on the host in numpy: the ragged `StepInputs`, per-row sampling metadata,
     and the penalty bookkeeping (which persistent row each request owns, which rows to clear).
  3. One transfer of that tree (on one device packed into a numpy buffer per dtype that the jitted
     call moves itself, unpacked by static slices inside the program: `_pack`; on a mesh one
     sharded `device_put`), one jitted step (forward + penalty-state update + sampler + logprobs,
     KV cache and state donated), one `jax.device_get` of the results.
  4. Unpack into plain Python: sampled ids, logprobs, prompt logprobs per request.
`execute` does all four; `launch` (1-3 without waiting) + `collect` (wait, 4) let the engine
schedule and launch the next step while this one runs (async scheduling): a decode token that
the still-running step samples is then a `PENDING_TOKEN` on the host, and the program takes it
from the previous program's sampled ids on the device (`BatchExtras.feed_rows`; every program
returns its sampled ids padded to a fixed `[R]`, the next one's `prev_tokens` input).

On a mesh (`mesh=`, see `llama.forward`) params and KV cache are placed by the sharding rules;
with `data` > 1 step 2 builds one ragged `StepInputs` per data replica (its own page pool, page
ids local to it), all padded to the same token/sequence buckets, stacked on a leading `[data]`
dim; sampling metadata, penalty rows and results are flat over `data * seq_bucket` rows.
With `pipeline` = S > 1 each replica's sequences are further split into S micro-batches of whole
sequences (`pipeline.split_microbatches`), each its own ragged step: the step's leading dims are
`[data?, S]` and the flat rows run replica-major, then micro-batch.
The sampler sees only the rows being sampled, vocab-sharded; XLA gathers those rows (never the
logits of every token, which the model does not compute outside prompt-logprob programs).

Penalty state lives on the device: `prompt_mask bool[R, V]` and `output_counts i32[R, V]`, one row
per running request. It is updated inside the step from the tokens being computed (a token at a
position past the prompt is an output token), so a preempted request that recomputes everything
rebuilds its counts exactly.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
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
from jaxinfer.models import llama
from jaxinfer.params import DTYPES
from jaxinfer.quantization import quantization_of
from jaxinfer.sampling import SamplingMetadata, compute_logprobs, sample
from jaxinfer.sampling_params import MAX_LOGPROBS, SamplingParams
from jaxinfer.step import StepInputs, build_step_arrays

logger = logging.getLogger(__name__)


@struct.dataclass
class BatchExtras:
    """Per-step inputs beyond the model's: penalty bookkeeping and prompt-logprob targets."""

    token_seq: jax.Array  # i32[T] index of each token's sequence in this step (padding -> S, dropped)
    token_is_output: jax.Array  # bool[T] token sits past its request's prompt
    seq_rows: jax.Array  # i32[S] penalty-state row of each sequence (padding -> the spare row)
    reset_rows: jax.Array  # bool[S] clear this sequence's row before counting (new owner)
    sample_rows: jax.Array  # i32[S] token row holding each sequence's last position
    target_ids: jax.Array  # i32[T] next prompt token per position (prompt-logprob programs only)
    feed_rows: jax.Array  # i32[T] row of prev_tokens that holds this (pending) token; -1: given


@struct.dataclass
class PenaltyState:
    prompt_mask: jax.Array  # bool[R, V]
    output_counts: jax.Array  # i32[R, V]


@dataclasses.dataclass
class Prepared:
    """A step's host inputs (`ModelRunner.prepare`): numpy pytrees plus the program's static key."""

    inputs: dict  # {"step": StepInputs, "extras": BatchExtras, "meta": SamplingMetadata} of numpy
    all_logits: bool  # the prompt-logprob variant of the program
    bucket: int  # token bucket
    places: list[tuple[int, int, int]]  # per scheduled request: (result row, token rows lo, hi)


@dataclasses.dataclass
class Launched:
    """A step running on the device (`ModelRunner.launch`): its results, not yet fetched."""

    sched: SchedulerOutput
    results: tuple[Any, Any]  # device arrays: (sampler output, prompt logprobs or None)
    places: list[tuple[int, int, int]]


@dataclasses.dataclass
class TokenLogprobs:
    """Logprob of one chosen token plus the top-k alternatives (token id -> logprob)."""

    token_id: int
    logprob: float
    top: dict[int, float]


def _step(params, cfg: ModelConfig, kv_caches, state: PenaltyState, prev_tokens: jax.Array,
          step: StepInputs, extras: BatchExtras, meta: SamplingMetadata, *, all_logits: bool,
          attention_backend: str, linear_backend: str = "xla", mesh: Any = None):
    """Pending tokens fed + forward + penalty bookkeeping + sampling, as one program."""
    stacked = step.token_ids.ndim >= 2  # [data?, M?, T]: per replica / micro-batch
    token_ids = jnp.where(extras.feed_rows >= 0, prev_tokens[jnp.maximum(extras.feed_rows, 0)],
                          step.token_ids.reshape(-1))
    step = step.replace(token_ids=token_ids.reshape(step.token_ids.shape))
    with jax.named_scope("penalty_state"):
        # One gather of this step's rows, small scatters on them, one write back.
        fresh = extras.reset_rows[:, None]
        prompt_mask = jnp.where(fresh, False, state.prompt_mask[extras.seq_rows])  # bool[S, V]
        output_counts = jnp.where(fresh, 0, state.output_counts[extras.seq_rows])  # i32[S, V]
        prompt_mask = prompt_mask.at[extras.token_seq, token_ids].max(
            ~extras.token_is_output, mode="drop")
        output_counts = output_counts.at[extras.token_seq, token_ids].add(
            extras.token_is_output.astype(jnp.int32), mode="drop")
        state = PenaltyState(state.prompt_mask.at[extras.seq_rows].set(prompt_mask),
                             state.output_counts.at[extras.seq_rows].set(output_counts))
    logits, kv_caches = llama.forward(params, cfg, step, kv_caches,
                                      attention_backend=attention_backend,
                                      linear_backend=linear_backend, mesh=mesh)
    if stacked:
        logits = logits.reshape(-1, logits.shape[-1])  # [data * rows, V]
    with jax.named_scope("sampler"):
        row_logits = jnp.take(logits, extras.sample_rows, axis=0) if all_logits else logits
        out = sample(row_logits, meta, prompt_mask, output_counts, num_logprobs=MAX_LOGPROBS)
    prompt = compute_logprobs(logits, extras.target_ids, MAX_LOGPROBS) if all_logits else None
    next_tokens = jnp.zeros_like(prev_tokens).at[:out.token_ids.shape[0]].set(out.token_ids)
    return (out, prompt), kv_caches, state, next_tokens


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
    return jax.tree.unflatten(treedef, [buffers[b][o:o + math.prod(shape)].reshape(shape)
                                        for b, o, shape in spec])


def _packed_step(params, cfg: ModelConfig, kv_caches, state: PenaltyState, prev_tokens, buffers, *,
                 layout: tuple, all_logits: bool, **backends):
    inputs = _unpack(buffers, layout)
    return _step(params, cfg, kv_caches, state, prev_tokens, inputs["step"], inputs["extras"],
                 inputs["meta"], all_logits=all_logits, **backends)


def default_token_buckets(max_num_batched_tokens: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to the token budget (which is always the last bucket)."""
    buckets = [1 << i for i in range(max(1, math.ceil(math.log2(max_num_batched_tokens))))]
    return tuple(sorted({b for b in buckets if b < max_num_batched_tokens} | {max_num_batched_tokens}))


class ModelRunner:
    """Owns the device state (params, KV cache, penalty rows) and runs one step per call."""

    def __init__(self, cfg: ModelConfig, params: Any, *, page_size: int, num_pages: int,
                 max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int,
                 dtype: str = "float32", attention_backend: str | None = None,
                 linear_backend: str | None = None, token_buckets: tuple[int, ...] | None = None,
                 mesh: Any = None, kv_cache_dtype: str = "auto") -> None:
        """`num_pages` and `max_num_seqs` are totals over the data replicas (each gets 1/data);
        `kv_cache_dtype="fp8"` stores the cache as `reference.Fp8KVCache` (see jaxinfer.attention)."""
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
            raise ValueError(f"largest token bucket {self.token_buckets[-1]} is below "
                             f"max_num_batched_tokens={max_num_batched_tokens}")
        if par.pipeline > 1:
            # NOTE: a 1-token micro-batch takes the reference attention's single-token loop, which
            # reads the cache as a loop operand; the next tick's KV write into that cache then makes
            # XLA:CPU copy the whole cache. Micro-batches are padded to >= 2 tokens instead
            # (tests/test_pipeline.py guards the compiled programs).
            self.token_buckets = tuple(sorted({max(b, 2) for b in self.token_buckets}))
        if self.data > 1 and (num_pages % self.data or max_num_seqs % self.data):
            raise ValueError(f"num_pages={num_pages} and max_num_seqs={max_num_seqs} must be "
                             f"multiples of data={self.data} (each replica gets an equal share)")
        self.seqs_per_replica = max_num_seqs // self.data
        kv_heads = shd.kv_cache_heads(cfg.num_kv_heads, par.dense)
        shape = attention.kv_cache_shape(attention_backend, num_pages, page_size, kv_heads,
                                         cfg.head_dim)
        attention.check_kv_cache_dtype(attention.resolve_backend(attention_backend), kv_cache_dtype)
        if kv_cache_dtype == "fp8" and par.pipeline > 1:
            raise ValueError("kv_cache_dtype='fp8' is not supported with a pipeline mesh axis > 1")
        self.kv_cache_dtype = kv_cache_dtype

        def new_caches():
            return tuple(attention.new_kv_cache(shape, DTYPES[dtype], kv_cache_dtype)
                         for _ in range(cfg.num_layers))

        rows = max_num_seqs + 1  # the last row is a spare that padding writes into
        if self.mesh is None:
            self.params = params
            self.kv_caches = new_caches()
            self.state = PenaltyState(jnp.zeros((rows, cfg.vocab_size), bool),
                                      jnp.zeros((rows, cfg.vocab_size), jnp.int32))
        else:
            rules = shd.model_rules(cfg, par)
            specs = llama.param_specs(cfg, quantization=quantization_of(params))
            if par.pipeline > 1:  # layers stacked by stage (see jaxinfer.pipeline)
                self.params = pipeline.place_params(params, specs, mesh, rules)
            else:
                self.params = jax.device_put(  # a no-op for params the loader already placed
                    params, params_lib.shardings(specs, mesh, rules))
            cache_sharding = jax.tree.map(lambda spec: NamedSharding(mesh, spec),
                                          llama.kv_cache_specs(cfg, par, new_caches()[0]))
            self._replicated = NamedSharding(mesh, PartitionSpec())
            self._step_sharding = (NamedSharding(mesh, PartitionSpec(shd.DATA)) if self.data > 1
                                   else self._replicated)
            zeros = jax.jit(new_caches, out_shardings=(cache_sharding,) * cfg.num_layers)
            self.kv_caches = zeros() if par.pipeline == 1 else pipeline.stage_kv_caches(
                cfg.num_layers, par.pipeline, shape, DTYPES[dtype], mesh, llama.kv_cache_spec(cfg, par))
            self.state = jax.jit(lambda: PenaltyState(jnp.zeros((rows, cfg.vocab_size), bool),
                                                      jnp.zeros((rows, cfg.vocab_size), jnp.int32)),
                                 out_shardings=self._replicated)()
        # Sampled-id rows of the largest program (every program pads its ids to this many).
        self.num_sample_rows = self.data * self.microbatches * self.seq_bucket(self.token_buckets[-1])
        zeros = functools.partial(jnp.zeros, self.num_sample_rows, jnp.int32)
        self._prev_tokens = zeros() if self.mesh is None else jax.jit(
            zeros, out_shardings=self._replicated)()
        self._last_rows: dict[str, int] = {}  # request id -> its row of _prev_tokens
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))
        self._rows: dict[str, int] = {}
        self._seeds: dict[str, int] = {}
        self._rng = random.Random()
        self.attention_backend = attention_backend = attention.resolve_backend(attention_backend)
        self.linear_backend = linear_backend = layers.resolve_linear_backend(linear_backend)
        if self.mesh is None:  # inputs packed into one buffer per dtype (see _pack)
            self._jit = jax.jit(functools.partial(_packed_step, attention_backend=attention_backend,
                                                  linear_backend=linear_backend),
                                static_argnames=("cfg", "all_logits", "layout"),
                                donate_argnames=("kv_caches", "state"))
        else:
            self._jit = jax.jit(functools.partial(_step, attention_backend=attention_backend,
                                                  linear_backend=linear_backend, mesh=self.mesh),
                                static_argnames=("cfg", "all_logits"),
                                donate_argnames=("kv_caches", "state"))
        self.num_compiled = 0
        self._compiled: set[tuple[int, int, bool]] = set()

    @property
    def kv_cache_bytes(self) -> int:
        return sum(c.size * c.dtype.itemsize for c in jax.tree.leaves(self.kv_caches))

    def bytes_per_device(self) -> dict[str, int]:
        """Parameter and KV-cache bytes held by the first device."""
        dev = jax.devices()[0] if self.mesh is None else self.mesh.devices.flat[0]

        def held(tree: Any) -> int:
            return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards
                       if s.device == dev)

        return {"params": held(self.params), "kv_cache": held(self.kv_caches)}

    def seq_bucket(self, num_tokens: int) -> int:
        return min(num_tokens, self.seqs_per_replica)

    def token_bucket(self, n: int) -> int:
        for b in self.token_buckets:
            if b >= n:
                return b
        raise ValueError(f"step of {n} tokens exceeds the largest bucket {self.token_buckets[-1]}")

    def _release(self, request_ids: list[str], *, finished: bool) -> None:
        """Frees penalty rows; a preempted request keeps its seed so it resamples identically."""
        for rid in request_ids:
            row = self._rows.pop(rid, None)
            if row is not None:
                self._free_rows.append(row)
            if finished:
                self._seeds.pop(rid, None)

    def _row_of(self, rid: str) -> tuple[int, bool]:
        if rid in self._rows:
            return self._rows[rid], False
        row = self._free_rows.pop()
        self._rows[rid] = row
        return row, True

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        prepared = self.prepare(sched)
        if prepared is None:
            return RunnerOutput(sampled_token_ids={})
        out, prompt = self.run(prepared)
        return self._unpack(sched.scheduled, out, prompt, prepared.places)

    def launch(self, sched: SchedulerOutput) -> Launched | None:
        """`execute` without waiting: the step is on the device when this returns (None: nothing
        was scheduled). Single-process only (a multi-host leader broadcasts `run`)."""
        prepared = self.prepare(sched)
        if prepared is None:
            return None
        results = self._call(prepared.inputs, prepared.all_logits)
        self._note_compiled(prepared.bucket, prepared.all_logits)
        return Launched(sched, results, prepared.places)

    def collect(self, launched: Launched) -> RunnerOutput:
        """Waits for a launched step and unpacks its results."""
        out, prompt = jax.device_get(launched.results)
        return self._unpack(launched.sched.scheduled, out, prompt, launched.places)

    def prepare(self, sched: SchedulerOutput) -> Prepared | None:
        """Host half of a step: row bookkeeping and every input as numpy (None: nothing to run).

        NOTE: the result is plain numpy plus two Python scalars, so a multi-host driver can build
        it on one process and broadcast it; `run` on every process then does the device half.
        """
        self._release(sched.finished, finished=True)
        self._release(sched.preempted, finished=False)
        if not sched.scheduled:
            return None
        return self._prepare(sched.scheduled)

    def run(self, prepared: Prepared) -> tuple[Any, Any]:
        """Device half: one transfer in, the jitted step, one transfer out (numpy results)."""
        out, prompt = self._call(prepared.inputs, prepared.all_logits)
        self._note_compiled(prepared.bucket, prepared.all_logits)
        return multihost.device_get((out, prompt))  # NOTE: results may span other processes

    def _note_compiled(self, bucket: int, all_logits: bool) -> None:
        key = (bucket, self.seq_bucket(bucket), all_logits)
        if key not in self._compiled:
            self._compiled.add(key)
            self.num_compiled = len(self._compiled)

    def compiled_program_count(self) -> int:
        """Programs in the step function's own jit cache (a recompile would grow it)."""
        return self._jit._cache_size()

    def _args(self, inputs: dict, all_logits: bool) -> tuple[tuple, dict]:
        """The step program's arguments for host `inputs`, moved to the device in one transfer."""
        head = (self.params, self.cfg, self.kv_caches, self.state, self._prev_tokens)
        if self.mesh is None:
            # NOTE: numpy buffers go straight to the jitted call, whose C++ path moves them to
            # the device faster than a separate `jax.device_put` (~0.3 ms less per step).
            buffers, layout = _pack(inputs)
            return (*head, buffers), {"layout": layout, "all_logits": all_logits}
        dev = self._put(inputs)
        return (*head, dev["step"], dev["extras"], dev["meta"]), {"all_logits": all_logits}

    def _call(self, inputs: dict, all_logits: bool) -> tuple[Any, Any]:
        """Runs the step program on host `inputs` (device results: sampler output, prompt logprobs)."""
        args, kwargs = self._args(inputs, all_logits)
        (out, prompt), self.kv_caches, self.state, self._prev_tokens = self._jit(*args, **kwargs)
        return out, prompt

    def _put(self, inputs: dict) -> dict:
        shardings = jax.tree.map(lambda _: self._replicated, inputs)
        shardings["step"] = jax.tree.map(lambda _: self._step_sharding, inputs["step"])
        return multihost.device_put_global(inputs, shardings)  # jax.device_put on one process

    def _prepare(self, scheduled: list[ScheduledRequest]) -> Prepared:
        data = self.data * self.microbatches  # ragged groups: replica-major, then micro-batch
        groups: list[list[int]] = [[] for _ in range(self.data)]
        for i, s in enumerate(scheduled):
            groups[s.replica].append(i)
        if self.microbatches > 1:  # whole sequences per micro-batch (see pipeline.split_microbatches)
            groups = [[g[k] for k in mb] for g in groups for mb in pipeline.split_microbatches(
                [len(scheduled[i].token_ids) for i in g], self.microbatches)]
        n_tok = max(sum(len(scheduled[i].token_ids) for i in g) for g in groups)
        t_bucket = self.token_bucket(n_tok)
        s_bucket = self.seq_bucket(t_bucket)
        all_logits = any(s.request.sampling.prompt_logprobs is not None
                         and s.start_pos < s.request.num_prompt_tokens for s in scheduled)
        n_rows = t_bucket if all_logits else s_bucket  # logits rows per replica

        spare = self.max_num_seqs
        token_seq = np.full(data * t_bucket, data * s_bucket, np.int32)
        token_is_output = np.zeros(data * t_bucket, bool)
        seq_rows = np.full(data * s_bucket, spare, np.int32)
        reset_rows = np.zeros(data * s_bucket, bool)
        sample_rows = np.zeros(data * s_bucket, np.int32)
        target_ids = np.zeros(data * t_bucket, np.int32)
        feed_rows = np.full(data * t_bucket, -1, np.int32)
        last_rows: dict[str, int] = {}
        # NOTE: sampling rows are flat over replicas (row r*s_bucket + j); gaps are padding rows.
        params = [SamplingParams(temperature=0.0)] * (data * s_bucket)
        seeds, steps = [0] * (data * s_bucket), [0] * (data * s_bucket)
        suppress: list[list[int]] = [[] for _ in range(data * s_bucket)]
        places: list[tuple[int, int, int]] = [(0, 0, 0)] * len(scheduled)
        per_replica = []
        for r, group in enumerate(groups):
            reqs = [scheduled[i] for i in group]
            cu = np.cumsum([0] + [len(s.token_ids) for s in reqs])
            if reqs:
                arrays = build_step_arrays(
                    [(s.token_ids, s.start_pos, s.page_ids) for s in reqs], self.page_size,
                    num_tokens=t_bucket, num_seqs=s_bucket, pages_per_seq=self.pages_per_seq,
                    logits_rows=list(range(int(cu[-1]))) if all_logits else list(cu[1:] - 1),
                    num_logits=n_rows)
            else:
                arrays = self._idle_arrays(t_bucket, n_rows)
            per_replica.append(arrays)
            for j, (i, s) in enumerate(zip(group, reqs)):
                req = s.request
                g = r * s_bucket + j
                lo, hi = r * t_bucket + cu[j], r * t_bucket + cu[j + 1]
                places[i] = (g, int(lo), int(hi))
                row, fresh = self._row_of(req.request_id)
                seq_rows[g], reset_rows[g] = row, fresh or s.start_pos == 0
                token_seq[lo:hi] = g
                if s.token_ids[-1] == PENDING_TOKEN:  # sampled by the previous step, still on device
                    if req.request_id not in self._last_rows or PENDING_TOKEN in s.token_ids[:-1]:
                        raise RuntimeError(f"request {req.request_id!r}: pending token not sampled "
                                           f"by the previous step")
                    feed_rows[hi - 1] = self._last_rows[req.request_id]
                if s.sample:
                    last_rows[req.request_id] = g
                token_is_output[lo:hi] = np.arange(s.start_pos, s.start_pos + (hi - lo)) >= req.num_prompt_tokens
                sample_rows[g] = hi - 1
                if all_logits:
                    nxt = req.token_slice(s.start_pos + 1, s.start_pos + 1 + (hi - lo))
                    target_ids[lo:lo + len(nxt)] = nxt
                sp = req.sampling
                if req.request_id not in self._seeds:
                    self._seeds[req.request_id] = sp.seed if sp.seed is not None else self._rng.getrandbits(63)
                # Index of the output token this row samples (pending ones counted, the row's own
                # included: the scheduler adds it when it schedules a sampling chunk).
                n_out = req.num_output_tokens + req.num_pending_tokens - int(s.sample)
                params[g], seeds[g], steps[g] = sp, self._seeds[req.request_id], n_out
                if n_out < sp.min_tokens:
                    suppress[g] = list(sp.stop_token_ids or []) + ([] if sp.ignore_eos else list(req.eos_token_ids))
        last = max((g for g, _, _ in places), default=-1) + 1
        meta = SamplingMetadata.from_params(params[:last], seeds[:last], steps[:last], suppress[:last],
                                            pad_to=data * s_bucket)
        extras = BatchExtras(token_seq=token_seq, token_is_output=token_is_output, seq_rows=seq_rows,
                             reset_rows=reset_rows, sample_rows=sample_rows, target_ids=target_ids,
                             feed_rows=feed_rows)
        self._last_rows = last_rows
        step = StepInputs(**self._stack(per_replica))
        return Prepared({"step": step, "extras": extras, "meta": meta}, all_logits, t_bucket, places)

    def _stack(self, per_replica: list[dict]) -> dict:
        if len(per_replica) == 1:
            return per_replica[0]
        lead = tuple(n for n in (self.data, self.microbatches) if n > 1)  # [data?, M?, ...]
        return {k: np.stack([a[k] for a in per_replica]).reshape(lead + per_replica[0][k].shape)
                for k in per_replica[0]}

    def _idle_arrays(self, t_bucket: int, n_rows: int) -> dict:
        """One replica's step arrays that compute nothing (no sequences, no cache writes)."""
        arrays = build_step_arrays([([0], 0, [0])], self.page_size, num_tokens=t_bucket,
                                   num_seqs=self.seq_bucket(t_bucket),
                                   pages_per_seq=self.pages_per_seq, num_logits=n_rows)
        arrays["slot_mapping"][:] = -1  # write nothing
        arrays["num_seqs"][:] = 0
        return arrays

    def _unpack(self, scheduled: list[ScheduledRequest], out: Any, prompt: Any,
                places: list[tuple[int, int, int]]) -> RunnerOutput:
        sampled, logprobs, prompt_lps = {}, {}, {}
        for s, (i, lo, hi) in zip(scheduled, places):
            req, sp = s.request, s.request.sampling
            rid = req.request_id
            if s.sample:
                tok = int(out.token_ids[i])
                sampled[rid] = tok
                if sp.logprobs is not None:
                    k = sp.logprobs
                    logprobs[rid] = TokenLogprobs(tok, float(out.logprobs[i]), dict(zip(
                        out.topk_ids[i, :k].tolist(), out.topk_logprobs[i, :k].tolist())))
            if prompt is not None and sp.prompt_logprobs is not None:
                chosen, top_ids, top_lps = prompt
                k = sp.prompt_logprobs
                entries = {}
                for t in range(lo, hi):
                    pos = s.start_pos + (t - lo) + 1  # the prompt position this row predicts
                    if pos >= req.num_prompt_tokens:
                        break
                    entries[pos] = TokenLogprobs(req.prompt_token_ids[pos], float(chosen[t]), dict(
                        zip(top_ids[t, :k].tolist(), top_lps[t, :k].tolist())))
                prompt_lps[rid] = entries
        return RunnerOutput(sampled_token_ids=sampled, logprobs=logprobs, prompt_logprobs=prompt_lps)

    def _idle_inputs(self, t_bucket: int, all_logits: bool) -> dict:
        """Inputs of a step that computes nothing (no sequences): used to compile a bucket."""
        s_bucket, data = self.seq_bucket(t_bucket), self.data * self.microbatches
        n_rows = t_bucket if all_logits else s_bucket
        arrays = self._stack([self._idle_arrays(t_bucket, n_rows) for _ in range(data)])
        extras = BatchExtras(
            token_seq=np.full(data * t_bucket, data * s_bucket, np.int32),
            token_is_output=np.zeros(data * t_bucket, bool),
            seq_rows=np.full(data * s_bucket, self.max_num_seqs, np.int32),
            reset_rows=np.zeros(data * s_bucket, bool), sample_rows=np.zeros(data * s_bucket, np.int32),
            target_ids=np.zeros(data * t_bucket, np.int32),
            feed_rows=np.full(data * t_bucket, -1, np.int32))
        meta = SamplingMetadata.from_params([], [], [], [], pad_to=data * s_bucket)
        return {"step": StepInputs(**arrays), "extras": extras, "meta": meta}

    def lower(self, t_bucket: int, all_logits: bool = False) -> Any:
        """The bucket's step program, lowered (for HLO inspection and tests)."""
        args, kwargs = self._args(self._idle_inputs(t_bucket, all_logits), all_logits)
        return self._jit.lower(*args, **kwargs)

    def warmup(self) -> int:
        """Compiles every (token bucket, logits variant) program; returns how many were built."""
        start = time.perf_counter()
        self._last_rows = {}  # NOTE: warmup programs overwrite the previous sampled ids
        for t_bucket in self.token_buckets:
            for all_logits in (False, True):
                out, _ = self._call(self._idle_inputs(t_bucket, all_logits), all_logits)
                jax.block_until_ready(out)
                self._note_compiled(t_bucket, all_logits)
        logger.info("warmup compiled %d programs in %.1fs", self.num_compiled,
                    time.perf_counter() - start)
        return self.num_compiled
