"""`StepInputs`: the device arrays of one ragged step (the model's only view of the batch).

Every scheduled sequence's new tokens are concatenated on one token axis `T` (decodes first, then
prefill chunks), padded to a bucket. Attention metadata follows the vLLM / Pallas vocabulary.
"""

from __future__ import annotations

import jax
import numpy as np
from flax import struct


@struct.dataclass
class StepInputs:
    token_ids: jax.Array  # i32[T]
    positions: jax.Array  # i32[T] absolute position of each token in its sequence
    slot_mapping: jax.Array  # i32[T] flat KV slot (page * page_size + offset); -1 for padding
    kv_lens: jax.Array  # i32[S] tokens in the cache after this step
    page_indices: jax.Array  # i32[S, pages_per_seq]
    cu_q_lens: jax.Array  # i32[S+1]
    num_seqs: jax.Array  # i32[1]
    logits_indices: jax.Array  # i32[N] token rows whose logits are returned
    lora_slots: jax.Array | None = None  # i32[T] each token's LoRA slot (0: none); enable_lora
    # Images (`jaxinfer.vision`): M embedding rows that replace the text embeddings of token rows
    # `mm_rows` (padding rows point past T and are dropped); None on steps without image tokens.
    mm_embeds: jax.Array | None = None  # f32[M, E]
    mm_rows: jax.Array | None = None  # i32[M]
    # M-RoPE (`ModelConfig.mrope_section`, Qwen2.5-VL): each token's (t, h, w) position rows
    # (`jaxinfer.vision.mrope`); None on steps without a request holding images (rows = positions).
    mrope_positions: jax.Array | None = None  # i32[3, T]
    # With images: the largest KV position each token may attend to (its own position; an image
    # token: its image's last, so an image's tokens see each other, HF's `token_type_ids` mask).
    # NOTE: set exactly when `mm_embeds` is (no extra program per bucket), never on a
    # `decode_only` step; the scheduler keeps each image's tokens in one chunk.
    causal_bound: jax.Array | None = None  # i32[T]
    # Static: every live sequence s holds exactly token s, one token each (a pure-decode step,
    # one replica). The runner marks such steps only where the attention backend has a decode-only
    # path (`gpu`), so no other backend compiles a second program per bucket.
    decode_only: bool = struct.field(pytree_node=False, default=False)


def build_step_arrays(
    seqs: list[tuple[list[int], int, list[int]]],
    page_size: int,
    *,
    num_tokens: int | None = None,
    num_seqs: int | None = None,
    pages_per_seq: int | None = None,
    logits_rows: list[int] | None = None,
    num_logits: int | None = None,
) -> dict[str, np.ndarray]:
    """Host-side numpy arrays of one ragged step (padded to the given bucket sizes).

    Args:
      seqs: per sequence `(new_token_ids, start_pos, page_ids)`, decodes first; `page_ids` must
        cover `start_pos + len(new_token_ids)` tokens.
      logits_rows: token rows whose logits to return; default the last token of each sequence.
    Returns:
      A dict with the `StepInputs` field names; `StepInputs(**jax.device_put(d))` builds the step.
    """
    t_real = sum(len(toks) for toks, _, _ in seqs)
    num_tokens = num_tokens or t_real
    num_seqs = num_seqs or len(seqs)
    need_pages = max((-(-(start + len(toks)) // page_size) for toks, start, _ in seqs), default=1)
    pages_per_seq = pages_per_seq or need_pages
    if t_real > num_tokens or len(seqs) > num_seqs or need_pages > pages_per_seq:
        raise ValueError(
            f"step of {t_real} tokens / {len(seqs)} seqs / {need_pages} pages does not "
            f"fit bucket ({num_tokens}, {num_seqs}, {pages_per_seq})"
        )
    token_ids = np.zeros(num_tokens, np.int32)
    positions = np.zeros(num_tokens, np.int32)
    slot_mapping = np.full(num_tokens, -1, np.int32)
    kv_lens = np.zeros(num_seqs, np.int32)
    page_indices = np.zeros((num_seqs, pages_per_seq), np.int32)
    cu_q_lens = np.full(num_seqs + 1, t_real, np.int32)
    cu_q_lens[0] = 0
    t = 0
    for s, (toks, start, pages) in enumerate(seqs):
        n = len(toks)
        pos = np.arange(start, start + n)
        token_ids[t : t + n] = toks
        positions[t : t + n] = pos
        pages_arr = np.asarray(pages, np.int32)
        slot_mapping[t : t + n] = pages_arr[pos // page_size] * page_size + pos % page_size
        kv_lens[s] = start + n
        page_indices[s, : len(pages)] = pages_arr[:pages_per_seq]
        t += n
        cu_q_lens[s + 1] = t
    if logits_rows is None:
        logits_rows = list(cu_q_lens[1 : len(seqs) + 1] - 1)
    num_logits = num_logits or len(logits_rows)
    logits_indices = np.zeros(num_logits, np.int32)
    logits_indices[: len(logits_rows)] = logits_rows
    return dict(
        token_ids=token_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        kv_lens=kv_lens,
        page_indices=page_indices,
        cu_q_lens=cu_q_lens,
        num_seqs=np.array([len(seqs)], np.int32),
        logits_indices=logits_indices,
    )
