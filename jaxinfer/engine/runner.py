"""ModelRunner: the only module that calls JAX on the hot path.

Flow of `execute(SchedulerOutput) -> RunnerOutput`:
  1. Pick the smallest token bucket that holds the step's tokens (the sequence bucket follows
     from it), so the set of compiled programs is fixed and `warmup()` builds all of them.
  2. Build every input on the host in numpy: the ragged `StepInputs`, per-row sampling metadata,
     and the penalty bookkeeping (which persistent row each request owns, which rows to clear).
  3. One `jax.device_put` of that tree, one jitted step (forward + penalty-state update + sampler
     + logprobs, KV cache and state donated), one `jax.device_get` of the results.
  4. Unpack into plain Python: sampled ids, logprobs, prompt logprobs per request.

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

from jaxinfer import attention
from jaxinfer.config import ModelConfig
from jaxinfer.engine.scheduler import RunnerOutput, ScheduledRequest, SchedulerOutput
from jaxinfer.models import llama
from jaxinfer.params import DTYPES
from jaxinfer.sampling import SamplingMetadata, compute_logprobs, sample
from jaxinfer.sampling_params import MAX_LOGPROBS
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


@dataclasses.dataclass
class TokenLogprobs:
    """Logprob of one chosen token plus the top-k alternatives (token id -> logprob)."""

    token_id: int
    logprob: float
    top: dict[int, float]


def _step(params, cfg: ModelConfig, kv_caches, state: PenaltyState, step: StepInputs,
          extras: BatchExtras, meta: SamplingMetadata, *, all_logits: bool, attention_backend: str):
    """forward + penalty bookkeeping + sampling, as one program."""
    with jax.named_scope("penalty_state"):
        # One gather of this step's rows, small scatters on them, one write back.
        fresh = extras.reset_rows[:, None]
        prompt_mask = jnp.where(fresh, False, state.prompt_mask[extras.seq_rows])  # bool[S, V]
        output_counts = jnp.where(fresh, 0, state.output_counts[extras.seq_rows])  # i32[S, V]
        prompt_mask = prompt_mask.at[extras.token_seq, step.token_ids].max(
            ~extras.token_is_output, mode="drop")
        output_counts = output_counts.at[extras.token_seq, step.token_ids].add(
            extras.token_is_output.astype(jnp.int32), mode="drop")
        state = PenaltyState(state.prompt_mask.at[extras.seq_rows].set(prompt_mask),
                             state.output_counts.at[extras.seq_rows].set(output_counts))
    logits, kv_caches = llama.forward(params, cfg, step, kv_caches,
                                      attention_backend=attention_backend)
    with jax.named_scope("sampler"):
        row_logits = jnp.take(logits, extras.sample_rows, axis=0) if all_logits else logits
        out = sample(row_logits, meta, prompt_mask, output_counts, num_logprobs=MAX_LOGPROBS)
    prompt = compute_logprobs(logits, extras.target_ids, MAX_LOGPROBS) if all_logits else None
    return (out, prompt), kv_caches, state


def default_token_buckets(max_num_batched_tokens: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to the token budget (which is always the last bucket)."""
    buckets = [1 << i for i in range(max(1, math.ceil(math.log2(max_num_batched_tokens))))]
    return tuple(sorted({b for b in buckets if b < max_num_batched_tokens} | {max_num_batched_tokens}))


class ModelRunner:
    """Owns the device state (params, KV cache, penalty rows) and runs one step per call."""

    def __init__(self, cfg: ModelConfig, params: Any, *, page_size: int, num_pages: int,
                 max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int,
                 dtype: str = "float32", attention_backend: str = "reference",
                 token_buckets: tuple[int, ...] | None = None) -> None:
        self.cfg, self.params = cfg, params
        self.page_size, self.num_pages = page_size, num_pages
        self.max_model_len, self.max_num_seqs = max_model_len, max_num_seqs
        self.pages_per_seq = math.ceil(max_model_len / page_size)
        self.token_buckets = token_buckets or default_token_buckets(max_num_batched_tokens)
        if self.token_buckets[-1] < max_num_batched_tokens:
            raise ValueError(f"largest token bucket {self.token_buckets[-1]} is below "
                             f"max_num_batched_tokens={max_num_batched_tokens}")
        shape = attention.kv_cache_shape(attention_backend, num_pages, page_size, cfg.num_kv_heads,
                                         cfg.head_dim)
        self.kv_caches = tuple(jnp.zeros(shape, DTYPES[dtype]) for _ in range(cfg.num_layers))
        rows = max_num_seqs + 1  # the last row is a spare that padding writes into
        self.state = PenaltyState(jnp.zeros((rows, cfg.vocab_size), bool),
                                  jnp.zeros((rows, cfg.vocab_size), jnp.int32))
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))
        self._rows: dict[str, int] = {}
        self._seeds: dict[str, int] = {}
        self._rng = random.Random()
        self.attention_backend = attention_backend
        self._jit = jax.jit(functools.partial(_step, attention_backend=attention_backend),
                            static_argnames=("cfg", "all_logits"),
                            donate_argnames=("kv_caches", "state"))
        self.num_compiled = 0
        self._compiled: set[tuple[int, int, bool]] = set()

    @property
    def kv_cache_bytes(self) -> int:
        return sum(c.size * c.dtype.itemsize for c in self.kv_caches)

    def seq_bucket(self, num_tokens: int) -> int:
        return min(num_tokens, self.max_num_seqs)

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
        return self._unpack(sched.scheduled, out, prompt, prepared.inputs)

    def prepare(self, sched: SchedulerOutput) -> Prepared | None:
        """Host half of a step: row bookkeeping and every input as numpy (None: nothing to run).

        NOTE: the result is plain numpy plus two Python scalars, so a multi-host driver can build
        it on one process and broadcast it; `run` on every process then does the device half.
        """
        self._release(sched.finished, finished=True)
        self._release(sched.preempted, finished=False)
        if not sched.scheduled:
            return None
        inputs, all_logits, bucket = self._prepare(sched.scheduled)
        return Prepared(inputs, all_logits, bucket)

    def run(self, prepared: Prepared) -> tuple[Any, Any]:
        """Device half: one transfer in, the jitted step, one transfer out (numpy results)."""
        dev = jax.device_put(prepared.inputs)
        (out, prompt), self.kv_caches, self.state = self._jit(
            self.params, self.cfg, self.kv_caches, self.state, dev["step"], dev["extras"],
            dev["meta"], all_logits=prepared.all_logits)
        self._note_compiled(prepared.bucket, prepared.all_logits)
        return jax.device_get((out, prompt))

    def _note_compiled(self, bucket: int, all_logits: bool) -> None:
        key = (bucket, self.seq_bucket(bucket), all_logits)
        if key not in self._compiled:
            self._compiled.add(key)
            self.num_compiled = len(self._compiled)

    def compiled_program_count(self) -> int:
        """Programs in the step function's own jit cache (a recompile would grow it)."""
        return self._jit._cache_size()

    def _prepare(self, scheduled: list[ScheduledRequest]) -> tuple[dict, bool, int]:
        n_tok = sum(len(s.token_ids) for s in scheduled)
        t_bucket = self.token_bucket(n_tok)
        s_bucket = self.seq_bucket(t_bucket)
        all_logits = any(s.request.sampling.prompt_logprobs is not None
                         and s.start_pos < s.request.num_prompt_tokens for s in scheduled)
        seqs = [(s.token_ids, s.start_pos, s.page_ids) for s in scheduled]
        cu = np.cumsum([0] + [len(s.token_ids) for s in scheduled])
        last_rows = list(cu[1:] - 1)
        arrays = build_step_arrays(
            seqs, self.page_size, num_tokens=t_bucket, num_seqs=s_bucket,
            pages_per_seq=self.pages_per_seq,
            logits_rows=list(range(n_tok)) if all_logits else last_rows,
            num_logits=t_bucket if all_logits else s_bucket)

        spare = self.max_num_seqs
        token_seq = np.full(t_bucket, s_bucket, np.int32)
        token_is_output = np.zeros(t_bucket, bool)
        seq_rows = np.full(s_bucket, spare, np.int32)
        reset_rows = np.zeros(s_bucket, bool)
        sample_rows = np.zeros(s_bucket, np.int32)
        target_ids = np.zeros(t_bucket, np.int32)
        params, seeds, steps, suppress = [], [], [], []
        for i, s in enumerate(scheduled):
            req = s.request
            row, fresh = self._row_of(req.request_id)
            seq_rows[i], reset_rows[i] = row, fresh or s.start_pos == 0
            lo, hi = cu[i], cu[i + 1]
            token_seq[lo:hi] = i
            token_is_output[lo:hi] = np.arange(s.start_pos, s.start_pos + (hi - lo)) >= req.num_prompt_tokens
            sample_rows[i] = hi - 1
            if all_logits:
                nxt = req.token_slice(s.start_pos + 1, s.start_pos + 1 + (hi - lo))
                target_ids[lo:lo + len(nxt)] = nxt
            sp = req.sampling
            if req.request_id not in self._seeds:
                self._seeds[req.request_id] = sp.seed if sp.seed is not None else self._rng.getrandbits(63)
            params.append(sp)
            seeds.append(self._seeds[req.request_id])
            steps.append(req.num_output_tokens)
            blocked = []
            if req.num_output_tokens < sp.min_tokens:
                blocked = list(sp.stop_token_ids or []) + ([] if sp.ignore_eos else list(req.eos_token_ids))
            suppress.append(blocked)
        meta = SamplingMetadata.from_params(params, seeds, steps, suppress, pad_to=s_bucket)
        extras = BatchExtras(token_seq=token_seq, token_is_output=token_is_output, seq_rows=seq_rows,
                             reset_rows=reset_rows, sample_rows=sample_rows, target_ids=target_ids)
        inputs = {"step": StepInputs(**arrays), "extras": extras, "meta": meta}
        return inputs, all_logits, t_bucket

    def _unpack(self, scheduled: list[ScheduledRequest], out: Any, prompt: Any,
                inputs: dict) -> RunnerOutput:
        sampled, logprobs, prompt_lps = {}, {}, {}
        cu = np.asarray(inputs["step"].cu_q_lens)
        for i, s in enumerate(scheduled):
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
                for t in range(cu[i], cu[i + 1]):
                    pos = s.start_pos + (t - cu[i]) + 1  # the prompt position this row predicts
                    if pos >= req.num_prompt_tokens:
                        break
                    entries[pos] = TokenLogprobs(req.prompt_token_ids[pos], float(chosen[t]), dict(
                        zip(top_ids[t, :k].tolist(), top_lps[t, :k].tolist())))
                prompt_lps[rid] = entries
        return RunnerOutput(sampled_token_ids=sampled, logprobs=logprobs, prompt_logprobs=prompt_lps)

    def _idle_inputs(self, t_bucket: int, all_logits: bool) -> dict:
        """Inputs of a step that computes nothing (no sequences): used to compile a bucket."""
        s_bucket = self.seq_bucket(t_bucket)
        spare = self.max_num_seqs
        arrays = build_step_arrays([([0], 0, [0])], self.page_size, num_tokens=t_bucket,
                                   num_seqs=s_bucket, pages_per_seq=self.pages_per_seq,
                                   num_logits=t_bucket if all_logits else s_bucket)
        arrays["slot_mapping"][:] = -1  # write nothing
        arrays["num_seqs"][:] = 0
        extras = BatchExtras(
            token_seq=np.full(t_bucket, s_bucket, np.int32), token_is_output=np.zeros(t_bucket, bool),
            seq_rows=np.full(s_bucket, spare, np.int32), reset_rows=np.zeros(s_bucket, bool),
            sample_rows=np.zeros(s_bucket, np.int32), target_ids=np.zeros(t_bucket, np.int32))
        meta = SamplingMetadata.from_params([], [], [], [], pad_to=s_bucket)
        return {"step": StepInputs(**arrays), "extras": extras, "meta": meta}

    def lower(self, t_bucket: int, all_logits: bool = False) -> Any:
        """The bucket's step program, lowered (for HLO inspection and tests)."""
        dev = jax.device_put(self._idle_inputs(t_bucket, all_logits))
        return self._jit.lower(self.params, self.cfg, self.kv_caches, self.state, dev["step"],
                               dev["extras"], dev["meta"], all_logits=all_logits)

    def warmup(self) -> int:
        """Compiles every (token bucket, logits variant) program; returns how many were built."""
        start = time.perf_counter()
        for t_bucket in self.token_buckets:
            for all_logits in (False, True):
                dev = jax.device_put(self._idle_inputs(t_bucket, all_logits))
                (out, _), self.kv_caches, self.state = self._jit(
                    self.params, self.cfg, self.kv_caches, self.state, dev["step"], dev["extras"],
                    dev["meta"], all_logits=all_logits)
                jax.block_until_ready(out)
                self._note_compiled(t_bucket, all_logits)
        logger.info("warmup compiled %d programs in %.1fs", self.num_compiled,
                    time.perf_counter() - start)
        return self.num_compiled
