"""The host step-input builder: a step's schedule -> every input of the step program, as numpy.

1. `prepare(sched)` patches the persistent `InputBatch` from the schedule's diffs (releases,
   joins, new pages), then `build`s the step.
2. `build` picks the smallest token bucket that holds the step's tokens (the sequence bucket
   follows from it) and the smallest page bucket that holds its longest page table, and builds
   every input with a handful of vectorized numpy gathers and scatters over the step's rows
   (`arrays`): the ragged `StepInputs` (one per data replica / pipeline micro-batch, stacked on
   leading dims, see `jaxinfer.engine.runner`), the penalty bookkeeping (`BatchExtras`), the
   sampling metadata (gathered again only when the step's rows or their parameters changed) and
   the `UnpackPlan` saying where each request's results land.
3. Structured output: the rows of constrained requests get their masks from
   `SchedulerOutput.token_bitmask` (`place_bitmask`); the others allow every token.

No device is touched: `scripts/bench_prepare.py` times this alone.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator

import numpy as np

from jaxinfer.engine.runner.buckets import Buckets
from jaxinfer.engine.runner.input_batch import InputBatch
from jaxinfer.engine.runner.programs import BatchExtras
from jaxinfer.engine.runner.ragged import ranks, step_arrays
from jaxinfer.engine.types import ScheduledRequest, SchedulerOutput
from jaxinfer.pipeline import split_microbatches
from jaxinfer.sampling import SamplingMetadata, needs_staged, staged_by_meta
from jaxinfer.step import StepInputs

_REQUEST_ID = operator.attrgetter("request_id")


@dataclasses.dataclass
class UnpackPlan:
    """Where a step's results go (host only: followers of a multi-host leader never see it)."""

    sample_ids: list[str]  # requests that sample, in the order of sample_slots
    sample_slots: list[int]  # their result rows
    logprob_rows: list[tuple[str, int, int]]  # (request id, result row, k) asking for logprobs
    # (request id, token rows lo, hi, start position, prompt length, k) asking for prompt logprobs
    prompt_rows: list[tuple[str, int, int, int, int, int]]
    target_ids: np.ndarray  # i32[T] the prompt token each token row predicts
    # (request id, its result row, its first verify row, its proposed tokens) of speculating rows
    spec: list[tuple[str, int, int, list[int]]] = dataclasses.field(default_factory=list)
    num_seq_rows: int = 0  # S: verify row w is result row S + w
    num_steps: int = 1  # multi-step: the steps whose ids come back (rows of the ids)


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
    # Multi-step (`SchedulerOutput.num_steps` > 1): the pure-decode steps one program runs
    num_steps: int = 1

    def __getstate__(self) -> dict:
        return {**self.__dict__, "plan": None}  # NOTE: a multi-host follower runs, never unpacks


class StepInputBuilder:
    """Builds each step's host inputs over one `InputBatch` (see the module docstring)."""

    def __init__(
        self,
        batch: InputBatch,
        buckets: Buckets,
        *,
        page_size: int,
        data: int = 1,
        microbatches: int = 1,
        bitmask_width: int,
        decode_only: bool = False,
    ) -> None:
        self.batch, self.buckets = batch, buckets
        self.decode_only = decode_only  # mark pure-decode steps (`StepInputs.decode_only`)
        self.page_size, self.max_num_seqs = page_size, batch.max_num_seqs
        self.data, self.microbatches = data, microbatches
        self.bitmask_width = bitmask_width
        self._meta_cache: tuple[int, np.ndarray, SamplingMetadata, bool] | None = None
        self._padding_metas: dict[int, SamplingMetadata] = {}
        self._staged_by_meta: tuple[SamplingMetadata, bool] | None = None  # (meta, its flag)

    def prepare(self, sched: SchedulerOutput) -> Prepared | None:
        """Host half of a step: patches the persistent batch and builds every input as numpy
        (None: nothing to run).

        NOTE: apart from its unpacking plan (which stays on this process) the result is plain numpy
        plus Python scalars, so a multi-host driver can build it on one process and broadcast it;
        `run` on every process then does the device half.
        """
        self.batch.release(sched.finished, finished=True)
        self.batch.release(sched.preempted, finished=False)
        if not sched.scheduled:
            return None
        prepared = self.build(sched.scheduled, sched.num_steps)
        if sched.bitmask_rows and sched.token_bitmask is not None:
            extras = prepared.inputs["extras"]
            bitmask = np.full((len(extras.seq_rows), self.bitmask_width), -1, np.int32)
            self.place_bitmask(sched, prepared.plan, bitmask)
            prepared.inputs["extras"] = extras.replace(token_bitmask=bitmask)
        prepared.inputs = self.with_staged(prepared.inputs)
        return prepared

    def with_staged(self, inputs: dict) -> dict:
        """`inputs` with `extras.sample_staged`: whether some sampled row needs the staged sampler
        (`sampling.needs_staged` on the host, over the rows' metadata, positions and bitmask), so
        the step's sampler launches no flag reductions. NOTE: the part that reads the metadata
        alone is kept while `build` returns the same metadata (its cache: a steady decode)."""
        step, extras, meta = inputs["step"], inputs["extras"], inputs["meta"]
        positions = np.asarray(step.kv_lens).reshape(-1)
        if len(extras.spec_positions):
            positions = np.concatenate([positions, extras.spec_positions])
        kept = self._staged_by_meta
        if kept is None or kept[0] is not meta:
            kept = self._staged_by_meta = (meta, staged_by_meta(meta, np))
        staged = kept[1] or needs_staged(meta, positions, extras.token_bitmask, np, by_meta=False)
        return {**inputs, "extras": extras.replace(sample_staged=np.array([staged], bool))}

    @staticmethod
    def place_bitmask(
        sched: SchedulerOutput,
        plan: UnpackPlan,
        bitmask: np.ndarray,  # i32[rows, ceil(V / 32)] all ones (-1), patched here
    ) -> None:
        """Structured output: each constrained row's allowed tokens into its result row."""
        if not sched.bitmask_rows or sched.token_bitmask is None:
            return
        for rid, slot in zip(plan.sample_ids, plan.sample_slots):
            k = sched.bitmask_rows.get(rid)
            if k is not None:
                bitmask[slot] = sched.token_bitmask[k]

    def padding_meta(self, rows: int) -> SamplingMetadata:
        """Sampling metadata of `rows` padding rows (greedy, no penalties, no logprobs)."""
        meta = self._padding_metas.get(rows)
        if meta is None or meta.suppress_ids.shape != (
            rows,
            self.batch.sampling.suppress_ids.shape[1],
        ):
            meta = self._padding_metas[rows] = self.batch.sampling.gather(
                np.full(rows, self.max_num_seqs, np.int32)
            )
        return meta

    def groups(self, scheduled: list[ScheduledRequest], q_lens: np.ndarray) -> np.ndarray | None:
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
            for m, mb in enumerate(split_microbatches(q_lens[idx].tolist(), self.microbatches)):
                group[idx[mb]] = r * self.microbatches + m
        return group

    def build(self, scheduled: list[ScheduledRequest], num_steps: int = 1) -> Prepared:
        """The step's inputs; with `num_steps` > 1 (multi-step, every row a decode) the page
        tables cover the tokens of all its steps, and the plan expects that many ids a row."""
        # NOTE: no Python loop per request: one C pass (`zip(*scheduled)`) turns the step's
        # ScheduledRequest tuples into a column per field; the checks and gathers that only matter
        # with proposals or prompt logprobs are skipped without them (a decode step has neither)
        n = len(scheduled)
        requests, token_lists, starts, new_pages, samples, _, joined, _, num_spec = zip(*scheduled)
        ids = list(map(_REQUEST_ID, requests))
        for i in itertools.compress(range(n), joined):
            self.batch.join(scheduled[i])
        rows = list(map(self.batch.rows.get, ids))
        if None in rows:
            raise RuntimeError(
                f"request {ids[rows.index(None)]!r} is scheduled as running but "
                f"has no row (its first schedule was not prepared)"
            )
        for i in itertools.compress(range(n), new_pages):
            if not joined[i]:
                self.batch.extend(rows[i], scheduled[i])
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
        spec_width = self.buckets.spec_width(n_spec)
        group = self.groups(scheduled, q_a)
        if spec_width and group is not None:
            raise RuntimeError("speculative tokens scheduled on a mesh with data or pipeline > 1")
        if n_spec and (((spec_a > 0) & ~sample_a).any() or (spec_a >= q_a).any()):
            raise RuntimeError("a speculative chunk must sample and hold its last known token")
        if group is None:
            order, n_tok = None, len(tokens)
        else:
            order = np.argsort(group, kind="stable")
            n_tok = int(np.bincount(group, weights=q_a).max())
        t_bucket = self.buckets.token_bucket(n_tok)
        last = int((starts_a + q_a).max()) + num_steps - 1  # tokens in cache after the last step
        p_bucket = self.buckets.page_bucket(-(-last // self.page_size))
        all_logits = bool(self.batch.wants_prompt_lps.any()) and bool(
            (self.batch.wants_prompt_lps[rows_a] & (starts_a < self.batch.prompt_len[rows_a])).any()
        )
        if order is not None:  # tokens of the sequences in group order
            src = np.cumsum(q_a) - q_a
            src = np.repeat(src[order], q_a[order]) + ranks(q_a[order])
            tokens_a = tokens_a[src]
            rows_a, starts_a, q_a, group = rows_a[order], starts_a[order], q_a[order], group[order]
            sample_a, joined_a = sample_a[order], np.array(joined, bool)[order]
        else:
            joined_a = np.array(joined, bool)
        step, extras, slot, tok_lo = self.arrays(
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
        if (
            self.decode_only
            and t_bucket > 1  # one token: always a decode, no mark needed
            and group is None
            and not n_spec
            and (q_a == 1).all()
        ):
            step = step.replace(decode_only=True)
        if order is not None:  # back to scheduled order
            slot[order], tok_lo[order] = slot.copy(), tok_lo.copy()
            rows_a, starts_a, q_a, sample_a = (
                np.array(rows, np.int32),
                np.array(starts, np.int32),
                np.array(q_lens, np.int32),
                np.array(samples, bool),
            )
        # Rows whose pending token this step samples: the next step feeds it from _prev_tokens.
        self.batch.last_sample.fill(-1)
        plain = (sample_a & (spec_a == 0)) if n_spec else sample_a
        self.batch.last_sample[rows_a[plain]] = slot[plain]
        meta_rows = extras.seq_rows
        if spec_width:
            spec_rows = np.full(spec_width, self.max_num_seqs, np.int32)
            spec_rows[: int(spec_a.sum())] = np.repeat(rows_a, spec_a)
            meta_rows = np.concatenate([extras.seq_rows, spec_rows])

        version = self.batch.sampling.version
        cache = self._meta_cache
        if (
            cache is not None
            and cache[0] == version
            and cache[1].shape == meta_rows.shape
            and (cache[1] == meta_rows).all()
        ):
            meta, fetch_logprobs = cache[2], cache[3]
        else:
            meta = self.batch.sampling.gather(meta_rows)
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
            for i in np.flatnonzero(self.batch.sampling.wants_logprobs[rows_a] & sample_a).tolist():
                s = scheduled[i]
                logprob_rows.append(
                    (s.request.request_id, int(slot[i]), s.request.sampling.logprobs)
                )
        if all_logits:
            for i in np.flatnonzero(self.batch.wants_prompt_lps[rows_a]).tolist():
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
        if num_steps > 1 and (n_spec or all_logits or (q_a != 1).any()):
            raise RuntimeError(
                f"a {num_steps}-step program takes only decodes without prompt logprobs or "
                f"proposals"
            )
        plan = UnpackPlan(
            sample_ids,
            slot[sample_a].tolist(),
            logprob_rows,
            prompt_rows,
            extras.target_ids,
            spec,
            s_rows,
            num_steps,
        )
        return Prepared(
            {"step": step, "extras": extras, "meta": meta},
            all_logits,
            t_bucket,
            p_bucket,
            fetch_logprobs,
            plan,
            spec_width,
            num_steps,
        )

    def arrays(
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
        """`ragged.step_arrays` over this builder's batch and shapes."""
        return step_arrays(
            self.batch,
            data=self.data,
            microbatches=self.microbatches,
            page_size=self.page_size,
            t_bucket=t_bucket,
            s_bucket=self.buckets.seq_bucket(t_bucket),
            p_bucket=p_bucket,
            all_logits=all_logits,
            rows=rows,
            starts=starts,
            q_lens=q_lens,
            tokens=tokens,
            joined=joined,
            group=group,
            num_spec=num_spec,
            spec_width=spec_width,
        )

    def idle_inputs(
        self,
        t_bucket: int,
        all_logits: bool,
        p_bucket: int,
        spec_width: int = 0,
        decode_only: bool = False,
    ) -> dict:
        """Inputs of a step that computes nothing (no sequences): used to compile a bucket (its
        pure-decode program with `decode_only`)."""
        none = np.zeros(0, np.int32)
        step, extras, _, _ = self.arrays(
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
        step = step.replace(decode_only=decode_only)
        meta = self.batch.sampling.gather(rows)
        return self.with_staged({"step": step, "extras": extras, "meta": meta})
