"""The model runner: the only package that calls JAX on the hot path.

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
     call moves itself, unpacked by static slices inside the program: `programs.pack`; on a mesh one
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

Rooms: `input_batch` (the persistent per-row host arrays), `step_inputs` (the numpy step-input
builder, steps 1-3), `buckets` (step 2's sizes and the warmup plan), `programs` (the jitted step,
multi-step program and sampler, step 4's packing), `program_table` (their compiled programs by
call key), `warmup` (every program built before the first request), `device_state` (params, KV caches, penalty rows on one device / a
mesh / pipeline stages; with `abstract=True` only their shapes and shardings on a target's
devices, for `jaxinfer.aot`, which compiles `ModelRunner.lower`'s programs for hardware this
machine lacks), `outputs` (step 5), `model_runner` (`ModelRunner`, composing them). The
`Runner` protocol (`jaxinfer.engine.types`) is what the engine core calls.
"""

from jaxinfer.engine.runner.buckets import default_page_buckets, default_token_buckets
from jaxinfer.engine.runner.model_runner import ModelRunner
from jaxinfer.engine.runner.programs import BatchExtras, PenaltyState
from jaxinfer.engine.runner.step_inputs import Prepared, UnpackPlan
from jaxinfer.engine.types import Launched, Runner

__all__ = [
    "BatchExtras",
    "Launched",
    "ModelRunner",
    "PenaltyState",
    "Prepared",
    "Runner",
    "UnpackPlan",
    "default_page_buckets",
    "default_token_buckets",
]
