"""Per-row sampling parameters: `SamplingMetadata` (one step's rows, device arrays) and the
persistent `SamplingRows` of a runner's batch they are gathered from (`jaxinfer.sampling`
re-exports both; the sampler itself lives there).

1. `SamplingRows.set(row, params, seed, suppress, until)` patches one slot's host columns when a
   request takes it; the spare row `num_rows` always holds the padding defaults.
2. `SamplingRows.gather(slots)` builds a step's `SamplingMetadata` (numpy fields) that the
   runner moves to the device; `SamplingMetadata.from_params` does both for a list of params.
"""

from __future__ import annotations

import flax.struct
import jax
import numpy as np

from jaxinfer.sampling_params import MAX_LOGIT_BIAS, SamplingParams

SUPPRESS_WIDTH = 8  # default static width of `suppress_ids`


@flax.struct.dataclass
class SamplingMetadata:
    """Per-row sampling parameters, one row per sampled sequence; padding rows are greedy."""

    temperature: jax.Array  # f32[S] (< GREEDY_EPS = greedy)
    top_k: jax.Array  # i32[S] (0 = off)
    top_p: jax.Array  # f32[S] (1 = off)
    min_p: jax.Array  # f32[S] (0 = off)
    repetition_penalty: jax.Array  # f32[S] (1 = off)
    frequency_penalty: jax.Array  # f32[S] (0 = off)
    presence_penalty: jax.Array  # f32[S] (0 = off)
    seed: jax.Array  # u32[S, 2] threefry key data (hi, lo) of the row's 64-bit seed
    suppress_ids: jax.Array  # i32[S, E] ids forbidden while position < suppress_until, -1 padded
    suppress_until: jax.Array  # i32[S] first position at which suppress_ids may be sampled again
    wants_logprobs: jax.Array  # bool[S] the row's request asked for `logprobs`
    bias_ids: jax.Array  # i32[S, MAX_LOGIT_BIAS] logit_bias token ids, -1 padded
    bias_values: jax.Array  # f32[S, MAX_LOGIT_BIAS] their biases (0 on padding)

    @staticmethod
    def from_params(
        params: list[SamplingParams],
        seeds: list[int],
        suppress: list[list[int]],
        pad_to: int,
        *,
        suppress_until: list[int] | None = None,
        suppress_width: int = SUPPRESS_WIDTH,
    ) -> SamplingMetadata:
        """Builds the metadata of `pad_to` rows on the host (numpy fields).

        Args:
          params: one `SamplingParams` per sampled row.
          seeds: each row's seed in [0, 2**64) (the caller draws one for requests without a seed).
          suppress: ids each row must not sample.
          pad_to: number of rows; rows past `len(params)` are greedy and harmless.
          suppress_until: per row, the first position at which its `suppress` ids are allowed
            again (default: never).
          suppress_width: static width E of `suppress_ids`.
        """
        n = len(params)
        if not len(seeds) == len(suppress) == n:
            raise ValueError(
                f"params, seeds and suppress need one entry per row; got "
                f"{n}, {len(seeds)}, {len(suppress)}"
            )
        if pad_to < n:
            raise ValueError(f"pad_to={pad_to} is smaller than the number of rows {n}")
        until = [np.iinfo(np.int32).max] * n if suppress_until is None else suppress_until
        rows = SamplingRows(pad_to, suppress_width=suppress_width)
        for row, (p, seed, ids, u) in enumerate(zip(params, seeds, suppress, until, strict=True)):
            rows.set(row, p, seed, ids, u)
        return rows.gather(np.arange(pad_to))


class SamplingRows:
    """Sampling parameters of a persistent batch: host columns with one row per slot, patched in
    place when a request takes or leaves a slot; `gather(slots)` builds a step's metadata.

    NOTE: row `num_rows` is a spare that always holds the padding defaults (greedy, no penalties);
    gather it for padding rows. A row suppressing more distinct ids than the width doubles the
    width of every row, which compiles one more program: size `suppress_width` for the usual stop
    lists.
    """

    def __init__(self, num_rows: int, *, suppress_width: int = SUPPRESS_WIDTH) -> None:
        rows = num_rows + 1
        self.num_rows = num_rows
        self.temperature = np.zeros(rows, np.float32)
        self.top_k = np.zeros(rows, np.int32)
        self.top_p = np.ones(rows, np.float32)
        self.min_p = np.zeros(rows, np.float32)
        self.repetition_penalty = np.ones(rows, np.float32)
        self.frequency_penalty = np.zeros(rows, np.float32)
        self.presence_penalty = np.zeros(rows, np.float32)
        self.seed = np.zeros((rows, 2), np.uint32)
        self.suppress_ids = np.full((rows, suppress_width), -1, np.int32)
        self.suppress_until = np.zeros(rows, np.int32)
        self.wants_logprobs = np.zeros(rows, np.bool_)
        self.bias_ids = np.full((rows, MAX_LOGIT_BIAS), -1, np.int32)
        self.bias_values = np.zeros((rows, MAX_LOGIT_BIAS), np.float32)
        self.version = 0  # bumped on every change (callers cache gathered metadata by it)

    def set(
        self, row: int, params: SamplingParams, seed: int, suppress: list[int], suppress_until: int
    ) -> None:
        """Row `row` now samples with `params` and `seed` (in [0, 2**64)), never choosing an id in
        `suppress` at a position below `suppress_until`."""
        if not 0 <= row < self.num_rows:
            raise ValueError(f"row {row} is outside [0, {self.num_rows})")
        if not 0 <= seed < 2**64:
            raise ValueError(f"seeds must be integers in [0, 2**64), got {seed}")
        ids = sorted(set(suppress))
        if any(i < 0 for i in ids):
            raise ValueError(f"suppress ids must be non-negative, got {suppress}")
        width = self.suppress_ids.shape[1]
        while width < len(ids):
            width *= 2
        if width > self.suppress_ids.shape[1]:
            wide = np.full((self.num_rows + 1, width), -1, np.int32)
            wide[:, : self.suppress_ids.shape[1]] = self.suppress_ids
            self.suppress_ids = wide
        self.temperature[row] = params.temperature
        self.top_k[row] = params.top_k
        self.top_p[row] = params.top_p
        self.min_p[row] = params.min_p
        self.repetition_penalty[row] = params.repetition_penalty
        self.frequency_penalty[row] = params.frequency_penalty
        self.presence_penalty[row] = params.presence_penalty
        self.seed[row] = (seed >> 32, seed & 0xFFFFFFFF)
        self.suppress_ids[row] = -1
        self.suppress_ids[row, : len(ids)] = ids
        self.suppress_until[row] = suppress_until if ids else 0
        self.wants_logprobs[row] = params.logprobs is not None
        bias = params.logit_bias or {}
        self.bias_ids[row], self.bias_values[row] = -1, 0.0
        self.bias_ids[row, : len(bias)] = list(bias)
        self.bias_values[row, : len(bias)] = list(bias.values())
        self.version += 1

    def gather(self, slots: np.ndarray) -> SamplingMetadata:  # slots: i32[S] rows, spare = padding
        """The metadata of a step whose sampled row i is persistent row `slots[i]` (numpy fields)."""
        return SamplingMetadata(
            temperature=self.temperature[slots],
            top_k=self.top_k[slots],
            top_p=self.top_p[slots],
            min_p=self.min_p[slots],
            repetition_penalty=self.repetition_penalty[slots],
            frequency_penalty=self.frequency_penalty[slots],
            presence_penalty=self.presence_penalty[slots],
            seed=self.seed[slots],
            suppress_ids=self.suppress_ids[slots],
            suppress_until=self.suppress_until[slots],
            wants_logprobs=self.wants_logprobs[slots],
            bias_ids=self.bias_ids[slots],
            bias_values=self.bias_values[slots],
        )
