"""The ragged arrays of one step: its sequences' rows of the persistent batch -> `StepInputs`
and `BatchExtras` as numpy (the step-input builder's inner part, `StepInputBuilder.arrays`).

1. Each sequence gets a result row (`slot`: group * S + its index in the group) and a first
   flat token row (group * T + tokens of earlier sequences in its group); a decode step on one
   group takes a shortcut (one token per sequence: both are the sequence's index).
2. Token-level arrays (ids, positions, KV slots, which sequence, prompt or output token,
   pending tokens fed from the previous program's sampled ids) are scattered to the token rows,
   sequence-level ones (kv lens, page tables, penalty rows, sample rows) to the result rows.
3. Speculative steps add W verify rows (one per proposed token) after the S result rows.
"""

from __future__ import annotations

import numpy as np

from jaxinfer.engine.request import PENDING_TOKEN
from jaxinfer.engine.runner.input_batch import InputBatch
from jaxinfer.engine.runner.programs import BatchExtras
from jaxinfer.step import StepInputs


def step_arrays(
    batch: InputBatch,
    *,
    data: int,
    microbatches: int,
    page_size: int,
    t_bucket: int,
    s_bucket: int,
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
    """A step's inputs for sequences in group order, by vectorized gathers and scatters over
    the rows of `batch` (`data` x `microbatches` ragged groups, each padded to `t_bucket` tokens
    and `s_bucket` sequences).

    Returns (StepInputs, BatchExtras, each sequence's result row i32[n], each sequence's first
    flat token row i32[n]).
    """
    n_groups = data * microbatches  # replica-major, then micro-batch
    t, ps = t_bucket, page_size
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
            offset = ranks(q_lens)  # i32[T_real] index of each token within its sequence
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
    slot_mapping[tok] = batch.page_table[row_of, pos // ps] * ps + pos % ps
    kv_lens = np.zeros(n_groups * s_bucket, np.int32)
    kv_lens[slot] = kv_end
    page_indices = np.zeros((n_groups * s_bucket, p_bucket), np.int32)
    page_indices[slot] = batch.page_table[rows, :p_bucket]
    if all_logits:
        every = np.arange(t, dtype=np.int32)
        logits_indices = np.where(every < group_tokens[:, None], every, 0).astype(np.int32)
    else:
        logits_indices = np.zeros(n_groups * s_bucket, np.int32)
        logits_indices[slot] = in_group + q_lens - 1

    token_seq = np.full(n_groups * t, n_groups * s_bucket, np.int32)
    token_seq[tok] = slot[seq_of]
    token_is_output = np.zeros(n_groups * t, bool)
    token_is_output[tok] = pos >= batch.prompt_len[row_of]
    seq_rows = np.full(n_groups * s_bucket, batch.max_num_seqs, np.int32)
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
        j = ranks(k)
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
        feed = batch.last_sample[row_of[pending]]
        bad = (feed < 0) | (pos[pending] != kv_end[seq_of[pending]] - 1)
        if bad.any():
            rid = next(r for r, v in batch.rows.items() if v == row_of[pending][bad][0])
            raise RuntimeError(f"request {rid!r}: pending token not sampled by the previous step")
        feed_rows[tok[pending]] = feed

    lead = tuple(d for d in (data, microbatches) if d > 1)  # [data?, M?, ...]
    lora_slots = None
    if batch.enable_lora:
        lora_slots = np.zeros(n_groups * t, np.int32)
        lora_slots[tok] = batch.lora_slot[row_of]
        lora_slots = lora_slots.reshape(lead + (t,))
    step = StepInputs(
        token_ids=token_ids.reshape(lead + (t,)),
        positions=positions.reshape(lead + (t,)),
        slot_mapping=slot_mapping.reshape(lead + (t,)),
        kv_lens=kv_lens.reshape(lead + (s_bucket,)),
        page_indices=page_indices.reshape(lead + (s_bucket, p_bucket)),
        cu_q_lens=cu_q_lens.reshape(lead + (s_bucket + 1,)),
        num_seqs=num_seqs.reshape(lead + (1,)),
        logits_indices=logits_indices.reshape(lead + (-1,)),
        lora_slots=lora_slots,
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


def ranks(counts: np.ndarray) -> np.ndarray:
    """i32[sum(counts)] 0, 1, ..., counts[0]-1, 0, 1, ..., counts[1]-1, ..."""
    total = int(counts.sum())
    return (np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)).astype(np.int32)
