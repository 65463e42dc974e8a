"""What the paged attention ops share: page walk, masks, online softmax, interpret plumbing.

`ragged_paged_attention/` (GQA over a `[P, page_size, 2*Hkv, D]` cache) and `mla_paged_attention/`
(MLA over a `[P, page_size, L + R]` latent cache) differ in their cache rows and their dots; how a
query block finds its keys, which keys it may see and how scores become an output are one rule,
written here once. Where Triton (GPU) and Mosaic (TPU) kernels need different forms, both live here.

1. Interpret plumbing: `interpret_mode(backend)` is how every caller (the model's attention ops,
   tests, benchmarks) runs a kernel backend whose hardware is not the current platform: Pallas
   interpret mode, `pltpu.InterpretParams()` for the TPU kernel, `True` for the GPU one, and
   `False` for the backends that run as they are ("reference" and "cpu" accept `interpret=` for
   signature parity and ignore it).
2. Kernel page walk (inside a Pallas program): `query_block_keys` reads a work item's lengths from
   the scalar refs and gives the keys its query block can see (`key_range`: causal end, window
   start rounded down to a page); the Triton kernels walk them in KV blocks of `pages_per_block`
   pages (`num_kv_blocks`, `kv_block_slots`: scalar-indexed page-table loads, page ids clamped
   into range). The Mosaic kernel DMAs the same pages (in its own file: one user).
3. Kernel masks and softmax: `causal_mask` (causal / length / sliding window), `apply_soft_cap`,
   then `online_softmax_step` (f32 running max, denominator and accumulator; masked scores get
   the finite `MASK_VALUE` and masked probabilities are exactly 0) and `normalize`. Statistics
   are `f32[R]` in the Triton form and `f32[R, 1]` in the Mosaic form (2-D vectors on TPU).
   `exp2_i8` turns an fp8 cache's int8 row exponents into exact f32 scales.
4. The pure-JAX references: `token_positions` (each query token's sequence and position),
   `reference_key_mask`, `reference_softmax_step` (the same update with -inf masking, on
   arbitrary head axes), and `walk_query_blocks` (query blocks of `QUERY_BLOCK` tokens: a block of
   one sequence gathers its pages once per KV block, `dense_pages_per_block`; a block spanning
   sequences gathers per token, `token_pages_per_block`).

Which query blocks a grid program runs (the work tables, query classes, block sizes, split-K)
is `ragged_paged_attention/block_sizes.py`, which the MLA kernel uses as it is.

NOTE: masked values are zeroed (by the callers, before their dots) and masked probabilities are
exactly 0, so NaN-filled unused pages never reach an output.

Legend: R = query rows of a kernel block, K = keys of a KV block, Q = query tokens of a
reference block, B = keys of a reference KV block.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import target

MASK_VALUE = -1e30  # finite, so a fully masked row never computes inf - inf

Interpret = bool | pltpu.InterpretParams  # what a kernel's `interpret=` takes


def interpret_mode(backend: str, platform: str | None = None) -> Interpret:
    """`interpret=` for kernel `backend` ("reference", "cpu", "gpu", "tpu") on `platform` (default:
    the target platform, `target.platform()`): False where it runs as it is, else Pallas interpret
    mode."""
    platform = platform or target.platform()
    if backend in ("reference", "cpu") or platform == backend:
        return False
    return pltpu.InterpretParams() if backend == "tpu" else True


def attention_cost(
    *,
    programs: int,
    rows: int,
    keys: int,
    score_width: int,
    value_width: int,
    cache_bytes: int,
    io_bytes: int,
) -> pl.CostEstimate:
    """The `cost_estimate` of one paged-attention `pallas_call`, so XLA's cost analysis counts it.

    A static bound: each of `programs` programs scores `rows` query rows against up to `keys`
    keys (dots of `score_width`, then `value_width` columns: 2 flops a multiply-add) with one exp
    per score; bytes are the cache bytes the call may read (`cache_bytes`, at most the pages its
    work items can reach) plus its q / output / metadata blocks (`io_bytes`).
    """
    scores = programs * rows * keys
    return pl.CostEstimate(
        flops=int(2 * scores * (score_width + value_width)),
        transcendentals=int(scores),
        bytes_accessed=int(cache_bytes + io_bytes),
    )


def nbytes(*xs) -> int:
    """Bytes of arrays / shape-dtype structs (pytrees of them)."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(xs))


def trunc_div(x, n: int):
    """x // n for x >= 0: a plain truncating division (Mosaic form; jnp's floor division adds sign
    fix-ups)."""
    return jax.lax.div(x, jnp.int32(n))


def key_range(
    kv_len,
    q_len,
    first,
    n_valid,
    *,
    page_size: int,
    sliding_window: int | None,
    div: Callable = operator.floordiv,
):
    """Keys a query block sees: (position of its first token, exclusive key end, first page).

    `first` is the block's first token within the sequence, `n_valid` its real tokens; the window
    start is rounded down to a page, so whole pages before every row's window are skipped. Works
    on scalars (a kernel program) and on per-sequence arrays (work tables); `div` rounds down.
    """
    first_pos = kv_len - q_len + first
    key_end = first_pos + n_valid
    page_lo = 0
    if sliding_window is not None:
        page_lo = div(jnp.maximum(first_pos - sliding_window + 1, 0), page_size)
    return first_pos, key_end, page_lo


def query_block_keys(
    w,
    s,
    work_qblk_ref,  # i32[W]
    kv_lens_ref,  # i32[S]
    cu_q_lens_ref,  # i32[S+1]
    *,
    block_q: int,
    page_size: int,
    sliding_window: int | None,
    div: Callable = operator.floordiv,
):
    """`key_range` of work item w's query block (sequence s), read from the scalar refs."""
    q_start = cu_q_lens_ref[s]
    q_len = cu_q_lens_ref[s + 1] - q_start
    kv_len = kv_lens_ref[s]
    first = work_qblk_ref[w] * block_q  # first query token of the block, within the sequence
    n_valid = jnp.minimum(q_len - first, block_q)
    return key_range(
        kv_len, q_len, first, n_valid, page_size=page_size, sliding_window=sliding_window, div=div
    )


def flat_page_table(page_indices: jax.Array, pages_per_block: int) -> tuple[int, jax.Array]:
    """(pages_per_row, i32[S * pages_per_row]): the page table padded by one KV block of columns
    (a block may run past a sequence's last page) and flattened for scalar loads."""
    pages_per_row = page_indices.shape[1] + pages_per_block
    return pages_per_row, jnp.pad(page_indices, ((0, 0), (0, pages_per_block))).reshape(-1)


def pad_heads(qg: jax.Array, gp: int) -> jax.Array:
    """q [T, Hkv, G, D] with G padded to `gp` zero heads (Triton: a power-of-two group)."""
    g = qg.shape[2]
    return qg if gp == g else jnp.pad(qg, ((0, 0), (0, 0), (0, gp - g), (0, 0)))


def num_kv_blocks(key_end, page_lo, *, page_size: int, block_k: int):
    """KV blocks of `block_k` keys from page `page_lo` up to `key_end` (Triton form)."""
    return pl.cdiv(key_end - page_lo * page_size, block_k)


def kv_block_slots(
    pages_ref,  # i32[S * pages_per_row] the page table flattened, padded by one KV block
    s,
    page_lo,
    b,
    offs,  # i32[K] iota
    *,
    page_size: int,
    pages_per_block: int,
    pages_per_row: int,
    num_pages: int,
):
    """(k_pos i32[K], slot i32[K]): positions and cache rows of KV block b of sequence s (Triton
    form: scalar-indexed page-table loads, then row gathers `cache[slot]`)."""
    page0 = page_lo + b * pages_per_block
    k_pos = page0 * page_size + offs
    page = pages_ref[s * pages_per_row + page0 + offs // page_size]
    slot = jnp.clip(page, 0, num_pages - 1) * page_size + offs % page_size
    return k_pos, slot


def exp2_i8(e):  # i8[...] -> f32 2**e, exact for the written range [-126, 127] (the exponent bits)
    # NOTE: clipped, so a stray -128 / -127 in an unwritten slot cannot become -inf / 0 * inf.
    return jax.lax.bitcast_convert_type(
        (jnp.clip(e.astype(jnp.int32), -126, 127) + 127) << 23, jnp.float32
    )


def apply_soft_cap(scores, soft_cap: float | None):
    """cap * tanh(scores / cap), or the scores as they are without a cap."""
    return scores if soft_cap is None else soft_cap * jnp.tanh(scores / soft_cap)


def causal_mask(q_pos, k_pos, key_end, sliding_window: int | None, bound=None):
    """bool[R, K]: key k_pos is in the sequence (< key_end), not after the row's causal bound
    (its position q_pos, or `bound` where given: an image token sees its whole image), and inside
    the window (measured from q_pos). Triton form: q_pos i32[R], k_pos i32[K], bound i32[R];
    Mosaic form: q_pos, k_pos i32[R, K] (2-D iotas), bound i32[R, 1]."""
    if k_pos.ndim == 1:
        last = q_pos if bound is None else bound
        mask = (k_pos[None, :] <= last[:, None]) & (k_pos[None, :] < key_end)
        if sliding_window is not None:
            mask &= q_pos[:, None] - k_pos[None, :] < sliding_window
        return mask
    mask = (k_pos < key_end) & (k_pos <= (q_pos if bound is None else bound))
    if sliding_window is not None:
        mask &= q_pos - k_pos < sliding_window
    return mask


def online_softmax_step(m, l, acc, scores, mask, pv: Callable):
    """One online-softmax update of a kernel's f32 state by a KV block's scores f32[R, K].

    m, l: running max and denominator, f32[R] (Triton form) or f32[R, 1] (Mosaic form); acc
    f32[R, width]; pv(p) -> f32[R, width] multiplies the block's probabilities by its values.
    """
    keep = m.ndim == 2
    scores = jnp.where(mask, scores, MASK_VALUE)
    m_new = jnp.maximum(m, scores.max(axis=1, keepdims=keep))
    p = jnp.where(mask, jnp.exp(scores - (m_new if keep else m_new[:, None])), 0.0)
    alpha = jnp.exp(m - m_new)
    l = alpha * l + p.sum(axis=1, keepdims=keep)
    out = pv(p)
    return m_new, l, (alpha if keep else alpha[:, None]) * acc + out


def normalize(acc, l):
    """acc f32[R, width] over its denominator l (f32[R] or f32[R, 1]); rows with none give 0."""
    den = jnp.where(l > 0, l, 1.0)
    return acc / (den if l.ndim == 2 else den[:, None])


QUERY_BLOCK = 32  # reference: query tokens per block
DENSE_KV_BLOCK = 256  # reference: keys per step when a query block belongs to one sequence
TOKEN_KV_BLOCK = 64  # reference: keys per step when it spans several (each token gathers its own)


def token_positions(cu_q_lens, kv_lens, num_seqs, num_tokens: int):
    """Each of `num_tokens` (padded) query tokens' sequence, validity, kv_len and position.

    Returns (seq i32[T], valid bool[T], kv_len i32[T] (0 for padding), q_pos i32[T], n_real: the
    real tokens); tokens past the last live sequence are padding.
    """
    s_max = kv_lens.shape[0]
    tok = jnp.arange(num_tokens, dtype=jnp.int32)
    n_real = cu_q_lens[jnp.minimum(num_seqs[0], s_max)]
    seq = jnp.searchsorted(cu_q_lens[1:], tok, side="right").astype(jnp.int32)
    valid = (seq < num_seqs[0]) & (tok < n_real)
    seq = jnp.minimum(seq, s_max - 1)
    q_start = cu_q_lens[seq]
    kv_len = jnp.where(valid, kv_lens[seq], 0)
    q_pos = kv_len - (cu_q_lens[seq + 1] - q_start) + (tok - q_start)  # i32[T]
    return seq, valid, kv_len, q_pos, n_real


def reference_key_mask(k_pos, valid, kv_len, q_pos, sliding_window: int | None, bound=None):
    """bool[Q, B]: the token is real, the key in its sequence, not after the token's causal bound
    (q_pos, or `bound` i32[Q] where given), inside the window (measured from q_pos)."""
    last = q_pos if bound is None else bound
    mask = valid[:, None] & (k_pos[None, :] < kv_len[:, None]) & (k_pos[None, :] <= last[:, None])
    if sliding_window is not None:
        mask &= q_pos[:, None] - k_pos[None, :] < sliding_window
    return mask


def reference_softmax_step(m, l, acc, s, mask, pv: Callable):
    """One online-softmax update of a reference's f32 state. s: f32[Q, heads..., B] scores;
    mask: bool[Q, B]; pv(p) -> f32[Q, heads..., width] multiplies the probabilities by the values."""
    s = jnp.where(jnp.expand_dims(mask, tuple(range(1, s.ndim - 1))), s, -jnp.inf)
    m_new = jnp.maximum(m, s.max(axis=-1))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p = jnp.exp(s - m_safe[..., None])
    alpha = jnp.exp(m - m_safe)
    return m_new, alpha * l + p.sum(axis=-1), alpha[..., None] * acc + pv(p)


def dense_pages_per_block(block_tokens: int, page_size: int, pages_per_seq: int) -> int:
    """Pages per KV block when a reference query block belongs to one sequence.

    NOTE: a lone decode token's block stays smaller than the page table: a gather of the whole
    table is loop-invariant, XLA:CPU hoists it and then copies the cache
    (tests/test_compiled_step.py).
    """
    cap = pages_per_seq if block_tokens > 1 else max(1, pages_per_seq // 2)
    return max(1, min(cap, DENSE_KV_BLOCK // page_size))


def token_pages_per_block(page_size: int, pages_per_seq: int) -> int:
    """Pages per KV block when a reference query block spans sequences (per-token gathers)."""
    return max(1, min(pages_per_seq, TOKEN_KV_BLOCK // page_size))


def walk_query_blocks(
    xs: tuple[
        jax.Array, ...
    ],  # (q [T_pad, ...], seq, valid, q_pos, kv_len, ...), each [T_pad, ...]
    dense_block: Callable,
    token_block: Callable,
    out: jax.Array,  # f32[T_pad, heads..., width]
    n_real,
    block_tokens: int,
) -> jax.Array:
    """The references' query-block loop: blocks of `block_tokens` tokens, each run by
    `dense_block` (its real tokens are one sequence's) or `token_block` (they span sequences),
    both (qb, sb, vb, pb, lb, ...) -> (m, l, acc) over the blocks of `xs`; padding tokens get
    zeros."""
    bq, t_pad = block_tokens, out.shape[0]

    def q_block(j, out):
        t0 = j * bq
        blk = tuple(jax.lax.dynamic_slice_in_dim(x, t0, bq) for x in xs)
        if bq == 1:  # a single token is always one sequence
            _, l, acc = dense_block(*blk)
        else:
            sb, vb = blk[1], blk[2]
            one_seq = jnp.all(jnp.where(vb, sb == sb[0], True))
            _, l, acc = jax.lax.cond(one_seq, dense_block, token_block, *blk)
        res = acc / jnp.where(l > 0, l, 1.0)[..., None]
        res = jnp.where(jnp.expand_dims(blk[2], tuple(range(1, res.ndim))), res, 0.0)
        return jax.lax.dynamic_update_slice_in_dim(out, res, t0, axis=0)

    if t_pad == bq:  # one query block: no loop around it
        return q_block(0, out)
    return jax.lax.fori_loop(0, -(-n_real // bq), q_block, out)
