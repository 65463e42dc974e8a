"""How the ragged paged attention kernels block their work: tuned sizes as data, and the work table.

Both kernels (`gpu.py`, `tpu.py`) share this plumbing; only the kernel bodies differ.

1. `get_block_sizes(backend, head_dim=, page_size=, dtype=, group=)` looks up `TUNED[(backend,
   head_dim, page_size, dtype)]`; a missing key falls back to `DEFAULTS[backend]`. The table stores
   query *rows* (tokens x padded query-head group, the matmul M dimension) because the group size
   G = Hq / Hkv varies per model; the lookup turns rows into tokens: `block_q = rows // G_pad`.
2. `query_classes` splits sequences by query length into at most two classes, each run as its own
   `pallas_call`: *decode* (q_len <= `decode_block_q`, rows = G_pad x a few tokens, so a decode does
   not waste most of a tall block) and *prefill* (the rest, `block_q` tokens per block). Each class
   has a static bound on its number of query blocks, so the grid is static.
3. `work_table` maps grid index w -> (sequence, query block within the sequence) for one class:
   per-sequence block counts, a cumulative sum, and a search. Items past the live blocks get
   sequence -1 and exit at once. The kernels receive the table as scalars (SMEM on TPU).
4. `gather_query_blocks` lays q out as `[W, Hkv, block_q * G_pad, D]` (one contiguous block per
   work item and KV head: the G query heads of a KV head are rows next to each other), and
   `scatter_query_blocks` gathers each token's rows back out of the kernel's output blocks;
   `gather_bound_blocks` lays a `causal_bound` out the same way, with each item's key end.
5. Split-K decode (GPU, flash-decoding): `split_work_table` gives each decode-class sequence
   `min(its KV blocks, budget // live decode sequences)` work items, each walking a contiguous,
   balanced share of the sequence's KV blocks (`split_range`), where budget =
   ceil(`decode_programs` / Hkv). `decode_programs` comes from `decode_programs_for`:
   `DECODE_PROGRAMS_PER_CORE` programs per streaming multiprocessor of the default GPU (132 SMs
   on an H100 when no GPU is attached). The split count is a traced value, so one compiled program
   serves batch 1 (many splits per sequence) and batch 256 (one split each) alike; the grid is
   the static bound max(class blocks, budget). `combine_splits` merges the partial results by
   their log-sum-exp.
6. Every search of a sorted table here (`search_sorted`) compares all pairs instead of
   `jnp.searchsorted`'s default binary search, which XLA runs as a while loop: a loop in a GPU
   step splits XLA's command buffers (CUDA graphs) and costs host launches on every trip; the
   tables hold at most a few hundred entries.

Legend: T = query tokens, S = sequences, W = work items (query blocks, or KV splits of a query
block), R = rows of a query block, Hkv = KV heads, G = query heads per KV head (G_pad: padded to a
power of two on GPU), D = head_dim.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels import target
from pallas_kernels.paged_common import key_range


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """One tuned entry. Rows count query tokens x padded group; keys come in whole pages."""

    q_rows: int  # rows of a prefill query block (matmul M)
    decode_q_rows: int  # rows of a decode-class block (0: no separate decode class)
    pages_per_block: int  # pages per KV block (block_k = pages_per_block * page_size)
    num_warps: int = 4  # GPU only
    num_stages: int = 2  # GPU only


@dataclasses.dataclass(frozen=True)
class KernelBlocks:
    """Block sizes resolved for one call (hashable: a static argument of the kernels' jit)."""

    block_q: int  # query tokens per prefill-class block
    decode_block_q: int  # query tokens per decode-class block; sequences with q_len <= it
    pages_per_block: int
    num_warps: int = 4
    num_stages: int = 2
    decode_programs: int = 0  # GPU split-K: programs the decode class aims for (0: no split)


# NOTE: not yet measured on hardware (no GPU/TPU in the session that wrote this); the values follow
# the usual flash-attention shapes: 64-row query tiles and 64-128-key tiles on GPU (Triton needs
# M >= 16 and powers of two), 128 rows and 512 keys on TPU (MXU-sized tiles, deep DMAs). Re-tune
# with `scripts/bench_attention.py` and record the results in BENCHMARKS.md.
TUNED: dict[tuple[str, int, int, str], BlockSizes] = {
    ("gpu", 64, 16, "bfloat16"): BlockSizes(64, 16, 8, num_warps=4, num_stages=2),
    ("gpu", 128, 16, "bfloat16"): BlockSizes(64, 16, 4, num_warps=4, num_stages=2),
    ("gpu", 128, 32, "bfloat16"): BlockSizes(64, 16, 2, num_warps=4, num_stages=2),
    ("gpu", 64, 16, "float32"): BlockSizes(64, 16, 4, num_warps=4, num_stages=2),
    ("gpu", 128, 16, "float32"): BlockSizes(32, 16, 2, num_warps=4, num_stages=2),
    ("tpu", 128, 16, "bfloat16"): BlockSizes(128, 8, 32),
    ("tpu", 128, 32, "bfloat16"): BlockSizes(128, 8, 16),
    ("tpu", 64, 16, "bfloat16"): BlockSizes(128, 8, 32),
    ("tpu", 128, 16, "float32"): BlockSizes(128, 8, 16),
}

# The documented default when a key is missing: 64 query rows, a 16-row decode class and 64 keys
# (GPU); 128 rows, an 8-row decode class and 512 keys but at most 32 pages (TPU: one DMA per page).
DEFAULT_KEYS = {"gpu": 64, "tpu": 512}
MAX_DEFAULT_PAGES = {"gpu": 64, "tpu": 32}
MIN_KEYS = {"gpu": 16, "tpu": 1}  # Triton's dot needs every dimension >= 16
DEFAULTS = {"gpu": BlockSizes(64, 16, 0), "tpu": BlockSizes(128, 8, 0)}
# Rows wider than 256 (MLA: latent + rope = 576) on GPU: 32 query rows, 32 keys (at most one page
# per block beyond that), 8 warps and one stage: the H100's 227 KiB of shared memory holds the
# query block and a KV block even at 128 heads (block_q * H rows); the 64-row, 64-key, two-stage
# default asked for 272 KiB at 16 heads (RESOURCE_EXHAUSTED, tests/test_accel_kernels.py).
# NOTE: 128 heads on one GPU need page_size <= 32 (a 64-key page block does not fit with them).
WIDE_GPU = BlockSizes(32, 16, 0, num_warps=8, num_stages=1)
WIDE_GPU_KEYS = 32

# NOTE: split-K decode aims for this many programs per SM: a decode program is small (4 warps, a
# 16-row tile), so several stay resident per SM and hide each other's page-gather latency; 4 per SM
# is the usual flash-decoding choice, not yet measured here (re-tune with bench_attention.py).
DECODE_PROGRAMS_PER_CORE = 4
H100_SMS = 132  # the streaming multiprocessors assumed when no GPU is attached (lowering, tests)


def decode_programs_for(backend: str) -> int:
    """The split-K program target of `backend` (0: the backend never splits).

    SMs come from the device of an enclosing `target.use_target` (compiling ahead of time for a
    GPU topology), else from the abstract device of an enclosing `jax.sharding.use_abstract_mesh`
    (lowering ahead of time), else from the attached GPU, else `H100_SMS`.
    """
    if backend != "gpu":
        return 0
    cores = None
    abstract = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    aimed = target.device()
    if aimed is not None and target.platform() == "gpu":
        cores = getattr(aimed, "core_count", None)
    elif abstract is not None and abstract.platform in ("gpu", "cuda", "rocm"):
        cores = abstract.num_cores
    else:
        dev = jax.devices()[0]
        cores = getattr(dev, "core_count", None) if dev.platform == "gpu" else None
    return DECODE_PROGRAMS_PER_CORE * int(cores or H100_SMS)


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def get_block_sizes(
    backend: str,
    *,
    head_dim: int,
    page_size: int,
    dtype,
    group: int,
    pages_per_seq: int,
    pow2: bool,
) -> KernelBlocks:
    """Resolves the table entry for one call.

    Args:
      backend: "gpu" or "tpu".
      group: query heads per KV head (G).
      pages_per_seq: page-table width; no KV block needs more pages than a sequence can hold.
      pow2: round G, the query blocks and the pages per block to powers of two (Triton).
    Returns:
      KernelBlocks with token counts: block_q = max(1, q_rows // G_pad), the same for decode.
    """
    if backend not in DEFAULTS:
        raise ValueError(f"no block sizes for backend {backend!r}")
    key = (backend, int(head_dim), int(page_size), jnp.dtype(dtype).name)
    entry = TUNED.get(key)
    if entry is None:
        wide = backend == "gpu" and head_dim > 256
        keys = WIDE_GPU_KEYS if wide else DEFAULT_KEYS[backend]
        pages = min(MAX_DEFAULT_PAGES[backend], max(1, keys // page_size))
        entry = dataclasses.replace(WIDE_GPU if wide else DEFAULTS[backend], pages_per_block=pages)
    g = next_pow2(group) if pow2 else group
    block_q = max(1, entry.q_rows // g)
    decode_block_q = max(1, entry.decode_q_rows // g) if entry.decode_q_rows else 0
    if pow2:
        block_q, decode_block_q = (
            next_pow2(block_q),
            next_pow2(decode_block_q) if decode_block_q else 0,
        )
    cap = next_pow2(pages_per_seq) if pow2 else pages_per_seq
    pages = max(1, min(entry.pages_per_block, cap), -(-MIN_KEYS[backend] // page_size))
    return KernelBlocks(
        block_q,
        decode_block_q,
        pages,
        entry.num_warps,
        entry.num_stages,
        decode_programs_for(backend) if decode_block_q else 0,
    )


@dataclasses.dataclass(frozen=True)
class QueryClass:
    """Sequences with min_q_len <= q_len <= max_q_len, in blocks of block_q tokens."""

    block_q: int
    min_q_len: int
    max_q_len: int
    num_work: int  # static bound on the class's number of query blocks (the grid size)


def query_classes(num_tokens: int, max_seqs: int, blocks: KernelBlocks) -> tuple[QueryClass, ...]:
    """At most two classes (decode, prefill) with static bounds on their query-block counts.

    NOTE: a class of n sequences holding at most T tokens needs sum(ceil(q_s / bq)) <=
    (T + n * (bq - 1)) // bq blocks; prefill-class sequences hold > decode_block_q tokens each, so
    at most T // (decode_block_q + 1) of them fit.
    """
    t, big = num_tokens, 2**31 - 1
    bd, bq = blocks.decode_block_q, blocks.block_q
    if not bd or bd >= bq:
        n = min(max_seqs, t)
        return (QueryClass(bq, 1, big, (t + n * (bq - 1)) // bq),)
    classes = [QueryClass(bd, 1, bd, min(max_seqs, t))]
    n = min(max_seqs, t // (bd + 1))
    if n:
        classes.append(QueryClass(bq, bd + 1, big, (t + n * (bq - 1)) // bq))
    return tuple(classes)


def search_sorted(table: jax.Array, values: jax.Array) -> jax.Array:
    """i32: `jnp.searchsorted(table, values, side="right")` without a loop (step 6 above): one
    fused compare-and-count over [values, table], or a sort where that would pass 2**22 pairs."""
    method = "compare_all" if table.size * values.size <= 1 << 22 else "sort"
    return jnp.searchsorted(table, values, side="right", method=method).astype(jnp.int32)


def _seq_of_tokens(cu_q_lens: jax.Array, num_tokens: int) -> jax.Array:
    tok = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = search_sorted(cu_q_lens[1:], tok)
    return jnp.minimum(seq, cu_q_lens.shape[0] - 2)  # i32[T]


def _class_blocks(cu_q_lens, num_seqs, cls: QueryClass):
    """Per-sequence block counts of one class and their exclusive cumulative sum."""
    s = cu_q_lens.shape[0] - 1
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]  # i32[S]
    member = (jnp.arange(s) < num_seqs[0]) & (q_lens >= cls.min_q_len) & (q_lens <= cls.max_q_len)
    nblk = jnp.where(member, (q_lens + cls.block_q - 1) // cls.block_q, 0)
    ends = jnp.cumsum(nblk).astype(jnp.int32)
    return member, ends - nblk, ends  # bool[S], i32[S], i32[S]


def work_table(
    cu_q_lens: jax.Array, num_seqs: jax.Array, cls: QueryClass
) -> tuple[jax.Array, jax.Array]:
    """Returns (seq i32[W], qblk i32[W]); seq is -1 for the items past the class's live blocks."""
    _, starts, ends = _class_blocks(cu_q_lens, num_seqs, cls)
    w = jnp.arange(cls.num_work, dtype=jnp.int32)
    seq = jnp.minimum(search_sorted(ends, w), ends.shape[0] - 1)
    live = w < ends[-1]
    return jnp.where(live, seq, -1), jnp.where(live, w - starts[seq], 0)


def gather_query_blocks(
    q: jax.Array,  # [T, Hkv, Gp, D]
    cu_q_lens: jax.Array,  # i32[S+1]
    seq: jax.Array,  # i32[W]
    qblk: jax.Array,  # i32[W]
    block_q: int,
) -> jax.Array:  # [W, Hkv, block_q * Gp, D]
    t, hkv, gp, d = q.shape
    safe = jnp.maximum(seq, 0)
    q_start = cu_q_lens[safe]
    q_len = cu_q_lens[safe + 1] - q_start
    local = qblk[:, None] * block_q + jnp.arange(block_q, dtype=jnp.int32)[None, :]  # i32[W, bq]
    ok = (seq[:, None] >= 0) & (local < q_len[:, None])
    tok = jnp.where(ok, q_start[:, None] + local, t)  # row t is the zero pad row
    qp = jnp.concatenate([q, jnp.zeros((1, hkv, gp, d), q.dtype)], axis=0)
    blocks = qp[tok]  # [W, bq, Hkv, Gp, D]
    return blocks.transpose(0, 2, 1, 3, 4).reshape(seq.shape[0], hkv, block_q * gp, d)


def gather_bound_blocks(
    bound: jax.Array,  # i32[T] each token's causal bound (`causal_bound`)
    kv_lens: jax.Array,  # i32[S]
    cu_q_lens: jax.Array,  # i32[S+1]
    seq: jax.Array,  # i32[W]
    qblk: jax.Array,  # i32[W]
    block_q: int,
    group: int,
) -> tuple[jax.Array, jax.Array]:
    """(i32[W, block_q * group] each query row's causal bound, i32[W] each work item's exclusive
    key end: past its rows' largest bound, within its sequence), in `gather_query_blocks`' rows
    (token-major, then query head within the group); rows of no token get -1."""
    safe = jnp.maximum(seq, 0)
    q_start = cu_q_lens[safe]
    q_len = cu_q_lens[safe + 1] - q_start
    local = qblk[:, None] * block_q + jnp.arange(block_q, dtype=jnp.int32)[None, :]  # i32[W, bq]
    ok = (seq[:, None] >= 0) & (local < q_len[:, None])
    b = jnp.where(ok, bound[jnp.where(ok, q_start[:, None] + local, 0)], -1)
    key_end = jnp.minimum(b.max(axis=1) + 1, kv_lens[safe])
    return jnp.repeat(b, group, axis=1).astype(jnp.int32), key_end.astype(jnp.int32)


def scatter_query_blocks(
    out_blocks: jax.Array,  # [W, Hkv, block_q * Gp, D]
    cu_q_lens: jax.Array,  # i32[S+1]
    num_seqs: jax.Array,  # i32[1]
    cls: QueryClass,
    num_tokens: int,
) -> tuple[jax.Array, jax.Array]:
    """Returns (out [T, Hkv, Gp, D], bool[T] tokens of this class) from the class's blocks."""
    w_max, hkv, r, d = out_blocks.shape
    gp = r // cls.block_q
    member, starts, _ = _class_blocks(cu_q_lens, num_seqs, cls)
    seq = _seq_of_tokens(cu_q_lens, num_tokens)
    local = jnp.arange(num_tokens, dtype=jnp.int32) - cu_q_lens[seq]
    mine = member[seq] & (jnp.arange(num_tokens) < cu_q_lens[num_seqs[0]])
    w = jnp.clip(starts[seq] + local // cls.block_q, 0, w_max - 1)
    blocks = out_blocks.reshape(w_max, hkv, cls.block_q, gp, d)
    return blocks[w, :, local % cls.block_q], mine


def split_range(num_blocks, split, num_splits):
    """The KV blocks [lo, hi) of split `split` of `num_splits`: balanced shares, none empty when
    num_splits <= num_blocks."""
    return split * num_blocks // num_splits, (split + 1) * num_blocks // num_splits


def split_budget(blocks: KernelBlocks, num_kv_heads: int) -> int:
    """Work items (per KV head) the decode class may use: ceil(decode_programs / Hkv)."""
    return -(-blocks.decode_programs // num_kv_heads)


@dataclasses.dataclass(frozen=True)
class SplitTable:
    """Decode-class work items with their KV splits (every array i32[W])."""

    seq: jax.Array  # the item's sequence; -1 past the live items
    split: jax.Array  # which split of the sequence's KV blocks
    num_splits: jax.Array  # how many splits the sequence has
    block: jax.Array  # the class block (output block) the item contributes to; W for dead items


def split_work_table(
    cu_q_lens: jax.Array,  # i32[S+1]
    kv_lens: jax.Array,  # i32[S]
    num_seqs: jax.Array,  # i32[1]
    cls: QueryClass,
    *,
    budget: int,
    num_work: int,
    page_size: int,
    block_k: int,
    sliding_window: int | None,
) -> SplitTable:
    """The decode class's work items, each sequence split over its KV blocks (step 5 above).

    NOTE: a decode-class sequence holds one query block (q_len <= block_q). With n live sequences
    each gets at most max(1, budget // n) splits, so the items never exceed max(n, budget) <=
    num_work, the static grid bound the caller passes (>= max(cls.num_work, budget)).
    """
    member, starts, _ = _class_blocks(cu_q_lens, num_seqs, cls)
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]  # i32[S]
    _, key_end, page_lo = key_range(
        kv_lens, q_lens, 0, q_lens, page_size=page_size, sliding_window=sliding_window
    )
    kv_blocks = (key_end - page_lo * page_size + block_k - 1) // block_k  # i32[S]
    live = jnp.maximum(member.sum(), 1)
    per_seq = jnp.clip(jnp.minimum(kv_blocks, budget // live), 1, None)
    splits = jnp.where(member, per_seq, 0).astype(jnp.int32)
    ends = jnp.cumsum(splits).astype(jnp.int32)
    w = jnp.arange(num_work, dtype=jnp.int32)
    seq = jnp.minimum(search_sorted(ends, w), ends.shape[0] - 1)
    ok = w < ends[-1]
    return SplitTable(
        seq=jnp.where(ok, seq, -1),
        split=jnp.where(ok, w - (ends - splits)[seq], 0),
        num_splits=jnp.where(ok, splits[seq], 1),
        block=jnp.where(ok, starts[seq], cls.num_work),
    )


def combine_splits(
    out: jax.Array,  # f32[W, Hkv, R, D] each item's output, normalized over its own keys
    lse: jax.Array,  # f32[W, Hkv, R] log-sum-exp of each item's scores (very negative: no keys)
    block: jax.Array,  # i32[W] the class block each item belongs to (num_blocks: dead item)
    num_blocks: int,
) -> jax.Array:  # f32[num_blocks, Hkv, R, D]
    """Flash-decoding merge: out_b = sum_i exp(lse_i - M_b) out_i / sum_i exp(lse_i - M_b) over
    the items i of block b, M_b = max_i lse_i. Items with no visible key weigh exp(-1e30 - M) = 0."""
    m = jax.ops.segment_max(lse, block, num_segments=num_blocks + 1)  # f32[B+1, Hkv, R]
    wgt = jnp.exp(lse - m[block])  # f32[W, Hkv, R]
    den = jax.ops.segment_sum(wgt, block, num_segments=num_blocks + 1)
    num = jax.ops.segment_sum(wgt[..., None] * out, block, num_segments=num_blocks + 1)
    return (num / jnp.where(den > 0, den, 1.0)[..., None])[:num_blocks]
